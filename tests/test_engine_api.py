"""The DeepSpeed-compatible surface of the engine, in one process."""
import pytest
import torch

import zkit
from zkit.core.plugin_manager import PluginError
from zkit.testing import run_ranks

import engine_ranks as er

SEED_CONFIG = {
    "train_batch_size": 16,
    "gradient_accumulation_steps": 2,
    "fp16": {"enabled": True},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


class Regression(torch.utils.data.Dataset):
    def __init__(self, n=64):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True) * 0.1

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class LossModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _model()

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.net(x.to(self.net[0].weight.dtype)).float(), y)


def test_seed_config_runs_as_a_deepspeed_script():
    model = LossModel()
    client_opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine, optimizer, loader, scheduler = zkit.initialize(
        model=model, optimizer=client_opt, model_parameters=model.parameters(), training_data=Regression(),
        config=SEED_CONFIG,
    )
    assert engine.records["partitioner"].name == "zero2"
    assert engine.records["allocator"].name == "host"  # zkit-offload answered offload_optimizer
    assert engine.train_micro_batch_size_per_gpu() == 8 and engine.gradient_accumulation_steps() == 2
    assert type(optimizer).__name__ in ("Adam", "CPUAdam")
    first = None
    for _ in range(3):
        for x, y in loader:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            first = loss.item() if first is None else first
    assert engine.global_steps == 12
    assert engine.loss_scale <= 2.0**16
    assert loss.item() < first


def test_offload_key_without_the_plugin_names_the_distribution(monkeypatch):
    monkeypatch.setenv("ZKIT_BLOCK_PLUGINS", "offload")
    # installed but blocked: the message says so instead of "not installed"
    with pytest.raises(ValueError, match=r"provided by the distribution 'zkit-offload', which is installed "
                                         r"\(version .*\) but registered no .* is its plugin blocked"):
        zkit.initialize(model=LossModel(), config={**SEED_CONFIG, "optimizer": {"type": "Adam"}})


def test_train_batch_runs_one_global_batch_from_the_dataloader():
    cfg = {"train_batch_size": 8, "gradient_accumulation_steps": 4, "steps_per_print": 100,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_max_lr": 1e-2}}}
    engine, _, _, scheduler = zkit.initialize(model=LossModel(), config=cfg, training_data=Regression())
    lrs = []
    for _ in range(3):
        loss = engine.train_batch()
        lrs.append(engine.get_lr()[0])
    assert engine.global_steps == 3 and engine.micro_steps == 12
    assert float(loss) > 0 and scheduler is not None
    assert lrs[0] < lrs[1] <= lrs[2] == pytest.approx(1e-2)  # warm-up reached the max


def test_no_sync_accumulates_locally_and_stage2_refuses_it():
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 100,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = zkit.initialize(model=LossModel(), config=cfg)
    data = Regression()
    with engine.no_sync():
        engine.backward(engine(data.x[:4], data.y[:4]))
    assert engine.is_gradient_accumulation_boundary()
    engine2, *_ = zkit.initialize(model=LossModel(), config={**cfg, "zero_optimization": {"stage": 2}})
    with pytest.raises(RuntimeError, match="no_sync\\(\\) is not possible with ZeRO stage 2"):
        with engine2.no_sync():
            pass


def test_train_and_eval_modes_reach_the_module():
    engine, *_ = zkit.initialize(model=LossModel(), config={"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.eval()
    assert not engine.module.training
    engine.train()
    assert engine.module.training


def test_client_optimizer_class_and_defaults_are_kept():
    model = LossModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.7)
    _, optimizer, _, _ = zkit.initialize(model=model, optimizer=opt, config={"train_batch_size": 2})
    assert isinstance(optimizer, torch.optim.SGD)
    assert optimizer.param_groups[0]["lr"] == 0.05 and optimizer.param_groups[0]["momentum"] == 0.7


def test_an_engine_without_optimizer_evaluates_and_refuses_to_train():
    engine, optimizer, _, _ = zkit.initialize(model=LossModel(), config={"train_batch_size": 2})
    assert optimizer is None  # DeepSpeed's answer for an inference/evaluation engine
    x, y = torch.ones(2, 8), torch.zeros(2, 1)
    assert torch.isfinite(engine(x, y))
    with pytest.raises(RuntimeError, match=r'this engine was built without an optimizer \(for inference or evaluation\): '
                                           r'to train, add "optimizer"'):
        engine.backward(engine(x, y))
    with pytest.raises(RuntimeError, match="built without an optimizer"):
        engine.step()


def test_missing_optimizer_and_bad_arguments_are_explained():
    with pytest.raises(ValueError, match="zkit.initialize needs config="):
        zkit.initialize(model=LossModel())
    with pytest.raises(ValueError, match="mpu= is not supported"):
        zkit.initialize(model=LossModel(), config={"train_batch_size": 2}, mpu=object())
    with pytest.raises(PluginError, match="unknown optimizer 'Adamm'"):
        zkit.initialize(model=LossModel(), config={"train_batch_size": 2, "optimizer": {"type": "Adamm"}})
    with pytest.raises(ValueError, match="engine.backward expects a scalar loss tensor"):
        engine, *_ = zkit.initialize(model=LossModel(), config={"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        engine.backward(torch.ones(3))


def test_stack_overrides_the_config():
    cfg = {"train_batch_size": 2, "zero_optimization": {"stage": 0}, "optimizer": {"type": "Adam"}}
    engine, optimizer, *_ = zkit.initialize(model=LossModel(), config=cfg, stack=zkit.Stack(partitioner="zero1", optimizer="sgd"))
    assert engine.records["partitioner"].name == "zero1"
    assert isinstance(optimizer, torch.optim.SGD)


def test_eval_batch_is_forward_only():
    out = run_ranks(er.eval_batch_leaves_training_alone, 2, timeout=300)[0]
    assert out["loss"] == pytest.approx(out["expected"], rel=1e-6)
    assert out["training"] and out["unchanged"] and out["steps"] == 0 and not out["grads"]


def test_a_client_lr_scheduler_schedules_the_optimizer_that_trains():
    model = LossModel()
    client = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(client, lambda step: 1.0 / (step + 1))
    engine, optimizer, _, lr_scheduler = zkit.initialize(
        model=model, optimizer=client, lr_scheduler=sched, config={"train_batch_size": 2})
    assert lr_scheduler is sched and sched.optimizer is optimizer
    lrs = [engine.get_lr()[0]]
    for _ in range(3):
        engine.backward(engine(torch.ones(2, 8), torch.zeros(2, 1)))
        engine.step()
        lrs.append(engine.get_lr()[0])
    assert lrs == pytest.approx([0.1, 0.05, 0.1 / 3, 0.025])


def test_a_client_adamw_instance_is_rebuilt_with_its_hyper_parameters():
    model = LossModel()
    client = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9), weight_decay=0.3)
    _, optimizer, _, _ = zkit.initialize(model=model, optimizer=client, config={"train_batch_size": 2})
    assert type(optimizer) is torch.optim.AdamW
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (0.01, (0.8, 0.9), 0.3)


def test_ranks_that_built_different_models_train_rank_0s():
    results = run_ranks(er.different_seeds, 2, timeout=120)
    assert torch.equal(results[0]["initial"], results[1]["initial"])
    assert torch.equal(results[0]["final"], results[1]["final"])


def test_zero_init_takes_deepspeeds_config_dict_or_path(tmp_path):
    import json

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}))
    import zkit.zero

    with zkit.zero.Init(config_dict_or_path=str(path)):
        layer = torch.nn.Linear(8, 4)
    assert getattr(layer.weight, "_zkit_unit", None) is not None and layer.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="give the config as config= or config_dict_or_path=, not both"):
        zkit.zero.Init(config={}, config_dict_or_path={})


def test_checkpointing_configure_takes_deepspeeds_mpu_and_config(tmp_path):
    import json

    from zkit.activations import recompute

    class Mpu:  # Megatron's model-parallel unit, as DeepSpeed scripts pass it
        def get_model_parallel_group(self):
            return None

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"activation_checkpointing": {"profile": True, "number_checkpoints": 3}}))
    for settings in (recompute.configure(Mpu(), deepspeed_config=str(path)),
                     recompute.configure(mpu_=Mpu(), deepspeed_config=json.loads(path.read_text()))):
        assert settings.profile is True and settings.number_checkpoints == 3
    with pytest.raises(ValueError, match="either as the first argument or as deepspeed_config=, not both"):
        recompute.configure({}, deepspeed_config={})
    recompute.configure()  # back to the defaults for the tests that follow


# -- a closed engine, data that runs out ------------------------------------------------------------
def test_a_closed_engine_refuses_every_use_saying_it_was_closed(tmp_path):
    """It trained on at 1 rank (its gradient hooks gone) and failed in torch's collectives at 2."""
    engine, *_ = zkit.initialize(model=LossModel(), config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    x, y = Regression(4)[:]
    engine.close()
    engine.close()  # twice is fine
    uses = {
        "forward": lambda: engine(x, y), "backward": lambda: engine.backward(torch.ones((), requires_grad=True)),
        "step": engine.step, "train_batch": lambda: engine.train_batch(iter([(x, y)])),
        "eval_batch": lambda: engine.eval_batch(iter([(x, y)])), "save_checkpoint": lambda: engine.save_checkpoint(
            str(tmp_path)), "load_checkpoint": lambda: engine.load_checkpoint(str(tmp_path)),
        "compile": engine.compile, "offload_states": engine.offload_states,
    }
    for name, use in uses.items():
        with pytest.raises(RuntimeError, match=f"^engine.{name} after engine.close\\(\\): a closed engine has released"):
            use()
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("stage", [0, 3])
def test_a_closed_engine_refuses_every_use_on_two_ranks(stage, tmp_path):
    for said in run_ranks(er.used_after_close, 2, args=(stage, str(tmp_path / "ckpt")), timeout=120):
        assert [s.split(" after ")[0] for s in said] == ["engine.forward", "engine.backward", "engine.step",
                                                         "engine.train_batch", "engine.save_checkpoint"]
        assert all(" after engine.close(): a closed engine has released its communicators" in s for s in said)
    assert not (tmp_path / "ckpt").exists()


def test_an_empty_dataset_is_refused_at_initialize():
    """The engine's dataloader cycled an empty dataset forever, and train_batch(iter(loader))
    raised a bare StopIteration."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with pytest.raises(ValueError, match=r"^training_data= is an empty dataset \(len\(\) is 0\): the engine's "
                                         r"dataloader would give no micro-batch$"):
        zkit.initialize(model=LossModel(), config=cfg, training_data=Regression(0))
    with pytest.raises(ValueError, match="^training_data= has 1 samples: over 1 ranks with micro-batches of 2 and "
                                         "dataloader_drop_last, the engine's dataloader gives no micro-batch$"):
        zkit.initialize(model=LossModel(), config={**cfg, "dataloader_drop_last": True}, training_data=Regression(1))


def test_a_data_iterator_that_runs_out_says_so():
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = zkit.initialize(model=LossModel(), config=cfg)
    with pytest.raises(StopIteration, match=r"^engine.train_batch: data_iter ran out after 0 of the 2 micro-batches "
                                            r"of a global batch \(an empty dataset, or the end of its data\)$"):
        engine.train_batch(iter([]))
    with pytest.raises(StopIteration, match="^engine.eval_batch: data_iter ran out after 1 of the 2 micro-batches"):
        engine.eval_batch(iter([Regression(2)[:]]))
    from zkit.data.repeating import RepeatingLoader

    with pytest.raises(ValueError, match=r"^RepeatingLoader: the loader \(list\) gives no batch, an empty dataset"):
        next(RepeatingLoader([]))


# -- model_parameters ---------------------------------------------------------------------------------
def _sgd():
    return {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def test_model_parameters_that_leave_out_a_trainable_parameter_are_refused_naming_it():
    """The parameters left out joined the first group and trained (1.7e-1 from torch's result,
    which keeps them unchanged); freezing them is the way to keep them."""
    model = LossModel()
    with pytest.raises(ValueError, match=r"^model_parameters leaves out 2 trainable parameter\(s\) of the model: "
                                         r"'net.2.weight', 'net.2.bias'. torch and DeepSpeed would not step them "
                                         r"though they take gradients; list them too, or freeze them "
                                         r"\(requires_grad_\(False\)\) before zkit.initialize$"):
        zkit.initialize(model=model, model_parameters=list(model.net[0].parameters()), config=_sgd())
    optimizer = torch.optim.SGD(model.net[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"^the param_groups of optimizer=SGD leaves out 2 trainable parameter"):
        zkit.initialize(model=model, optimizer=optimizer, config={"train_micro_batch_size_per_gpu": 4})
    model.net[2].requires_grad_(False)  # frozen: not listed, and kept as it is
    engine, *_ = zkit.initialize(model=model, model_parameters=list(model.net[0].parameters()), config=_sgd())
    head = model.net[2].weight.detach().clone()
    x, y = Regression(4)[:]
    engine.backward(engine(x, y))
    engine.step()
    assert torch.equal(model.net[2].weight, head)


def test_a_parameter_in_two_groups_is_refused_naming_it():
    """It was accepted and trained at the second group's learning rate; torch.optim refuses it."""
    model = LossModel()
    twice = [{"params": list(model.parameters())}, {"params": [model.net[0].bias], "lr": 1.0}]
    with pytest.raises(ValueError, match=r"^model_parameters lists the parameter 'net.0.bias' in groups 0 and 1: list "
                                         r"each parameter once \(torch.optim refuses 'some parameters appear in more "
                                         r"than one parameter group'\)$"):
        zkit.initialize(model=model, model_parameters=twice, config=_sgd())
    with pytest.raises(ValueError, match="^model_parameters lists the parameter 'net.0.bias' twice in group 0"):
        zkit.initialize(model=model, model_parameters=list(model.parameters()) + [model.net[0].bias], config=_sgd())


def test_model_parameters_are_refused_alike_on_every_rank_at_every_stage():
    for said in run_ranks(er.left_out_or_twice, 2, args=([0, 1, 2, 3],), timeout=180):
        assert said[0::2] == ["model_parameters leaves out 2 trainable parameter(s) of the model: 'norm.weight', "
                              "'norm.bias'. torch and DeepSpeed would not step them though they take gradients; list "
                              "them too, or freeze them (requires_grad_(False)) before zkit.initialize"] * 4
        assert said[1::2] == ["model_parameters lists the parameter 'mix.weight' in groups 0 and 1: list each "
                              "parameter once (torch.optim refuses 'some parameters appear in more than one parameter "
                              "group')"] * 4
