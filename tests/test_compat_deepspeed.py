"""DeepSpeed's public names (the drop-in's ``deepspeed``; ``import zkit as deepspeed``): DeepSpeed's
signatures and semantics, and clear refusals for what zkit does not do."""
from __future__ import annotations

import argparse
import importlib.util
import logging

import pytest
import torch

import compat_ranks
import zkit
import deepspeed
from zkit.testing import run_ranks


def test_comm_is_torch_distributed_under_deepspeeds_names():
    results = run_ranks(compat_ranks.comm_collectives, 2)
    for r in results:
        assert r["world"] == 2 and r["init"] and r["ranks"] == [0, 1]
        assert r["sum"] == 3.0  # 1 + 2
        assert r["gathered"] == [0.0, 1.0]
        assert r["rs"] == 2 * r["rank"] + 1  # chunk r of (arange + 0) + (arange + 1)
        assert r["bcast"] == 1.0
        assert r["objs"] == [{"rank": 0}, {"rank": 1}]


def test_a_deepspeedexamples_style_script_trains(tmp_path):
    results = run_ranks(compat_ranks.script_with_args, 2, args=(str(tmp_path),))
    for rank, r in enumerate(results):
        assert r["stage"] == 2 and r["dp"] == 2 and r["rank"] == rank and r["local_rank"] == rank  # one node
        assert len(r["losses"]) == 2


def test_import_zkit_as_deepspeed_gives_zkits_own_api():
    import zkit as ds
    import zkit.core.engine

    assert ds.initialize is zkit.core.engine.initialize
    assert ds.zero.Init is deepspeed.zero.Init and ds.zero.GatheredParameters is deepspeed.zero.GatheredParameters
    assert ds.checkpointing.configure is deepspeed.checkpointing.configure
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'$"):
        ds.not_a_name


@pytest.mark.parametrize("name", ["comm", "accelerator", "ops", "pipe", "utils", "runtime", "DeepSpeedEngine",
                                  "init_distributed", "get_accelerator"])
def test_import_zkit_as_deepspeed_names_the_dropin_for_deepspeeds_own_names(name):
    import zkit as ds

    with pytest.raises(AttributeError, match=(
            rf"module 'zkit' has no attribute '{name}': deepspeed\.{name} is DeepSpeed's name, not zkit's\. "
            r"For DeepSpeed's API on zkit, install zkit's drop-in, the 'deepspeed' distribution "
            r"\(pip install -e plugins/zkit-deepspeed\), and `import deepspeed` instead of `import zkit as deepspeed`")):
        getattr(ds, name)
    # the drop-in has each of them (deepspeed.pipe as a submodule, imported on demand as in DeepSpeed)
    assert hasattr(deepspeed, name) or importlib.util.find_spec(f"deepspeed.{name}") is not None


def test_add_config_arguments_parses_deepspeeds_flags():
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed is True and args.deepspeed_config == "ds.json"
    assert args.deepscale is False and args.deepscale_config is None
    assert any(g.title == "DeepSpeed" for g in parser._action_groups)


def test_initialize_refuses_a_config_given_twice_and_mesh_param(tmp_path):
    args = argparse.Namespace(deepspeed_config=str(tmp_path / "a.json"))
    with pytest.raises(ValueError, match="the config was given twice"):
        deepspeed.initialize(args=args, model=torch.nn.Linear(2, 2), config={"train_batch_size": 1})
    with pytest.raises(ValueError, match="mesh_param=.*not supported"):
        deepspeed.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_size": 1}, mesh_param=(1, 1))


def test_init_inference_is_refused_with_what_to_do():
    with pytest.raises(NotImplementedError, match="init_inference is not supported.*without an optimizer"):
        deepspeed.init_inference(torch.nn.Linear(2, 2))


def test_accelerator_on_cpu():
    acc = deepspeed.get_accelerator()
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the CPU accelerator is not the default")
    assert acc.device_name() == "cpu" and acc.device_name(0) == "cpu" and acc.current_device_name() == "cpu"
    assert acc.communication_backend_name() == "gloo" and acc.is_available()
    assert acc.is_bf16_supported() and torch.bfloat16 in acc.supported_dtypes()
    assert acc.memory_allocated() > 0  # host memory on the CPU accelerator, as DeepSpeed's
    acc.synchronize(), acc.empty_cache()
    acc.manual_seed(3)
    a = torch.rand(2)
    acc.manual_seed(3)
    assert torch.equal(a, torch.rand(2))
    t = acc.FloatTensor([1, 2])
    assert t.dtype == torch.float32 and t.device.type == "cpu"
    assert acc.LongTensor(3).shape == (3,)


def test_accelerator_choice_is_checked(monkeypatch):
    from deepspeed.accelerator import real_accelerator as accelerator

    monkeypatch.setattr(accelerator, "_current", None)
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ValueError, match="accelerator 'xpu'.*not one zkit has: cuda, cpu"):
        accelerator.get_accelerator()
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert accelerator.get_accelerator().device_name() == "cpu"


def test_deepspeed_config_attributes(tmp_path):
    cfg = deepspeed.DeepSpeedConfig({"train_batch_size": 8, "gradient_accumulation_steps": 2,
                                     "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
                                     "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    assert cfg.train_micro_batch_size_per_gpu == 4 and cfg.gradient_accumulation_steps == 2
    assert cfg.zero_optimization_stage == 3 and cfg.zero_enabled and cfg.bfloat16_enabled and not cfg.fp16_enabled
    assert cfg.optimizer_name == "adamw" and cfg.optimizer_params == {"lr": 0.1}
    with pytest.raises(deepspeed.DeepSpeedConfigError, match="train_batch_sze"):
        deepspeed.DeepSpeedConfig({"train_batch_size": 8, "train_batch_sze": 8})


def _same_steps(make_ours, make_reference, shape: tuple[int, int], rtol: float) -> None:
    torch.manual_seed(0)
    p1 = torch.nn.Parameter(torch.randn(*shape))
    p2 = torch.nn.Parameter(p1.detach().clone())
    o1, o2 = make_ours([p1]), make_reference([p2])
    for _ in range(3):
        g = torch.randn(*shape)
        p1.grad, p2.grad = g.clone(), g.clone()
        o1.step(), o2.step()
    torch.testing.assert_close(p1, p2, rtol=rtol, atol=rtol / 10)


def test_fused_adam_is_adamw_by_default_and_adam_with_adam_w_mode_false():
    from deepspeed.ops.adam import FusedAdam

    for adam_w_mode, reference in ((True, torch.optim.AdamW), (False, torch.optim.Adam)):
        _same_steps(lambda p: FusedAdam(p, lr=0.1, weight_decay=0.2, adam_w_mode=adam_w_mode),
                    lambda p: reference(p, lr=0.1, weight_decay=0.2), (5, 4), 1e-6)
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam(p, amsgrad=True)
    with pytest.raises(ValueError, match="bias_correction=False"):
        FusedAdam(p, bias_correction=False)


def test_deepspeed_cpu_adam_defaults_to_decoupled_decay():
    pytest.importorskip("zkit_offload")
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    # DeepSpeed's defaults: adamw_mode=True
    _same_steps(lambda p: DeepSpeedCPUAdam(p, lr=0.05, weight_decay=0.3),
                lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.3), (7, 3), 1e-5)
    with pytest.raises(ValueError, match="fp32_optimizer_states=False"):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.ones(2))], fp32_optimizer_states=False)


def test_runtime_utils_and_utils():
    from deepspeed.runtime.utils import move_to_device, set_random_seed
    from deepspeed.utils import RepeatingLoader

    set_random_seed(5)
    a = torch.rand(3)
    set_random_seed(5)
    assert torch.equal(a, torch.rand(3))
    moved = move_to_device({"x": [torch.ones(1), (torch.zeros(1), 3)]}, "cpu")
    assert moved["x"][1][1] == 3 and isinstance(moved["x"][1], tuple)
    it = RepeatingLoader([1, 2])
    assert [next(it) for _ in range(5)] == [1, 2, 1, 2, 1]


def test_log_dist_names_the_rank(caplog):
    from deepspeed.utils import log_dist

    # outside a process group every call logs, as rank -1; inside, only the listed ranks do
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else -1
    with caplog.at_level(logging.INFO, logger="zkit"):
        log_dist("hello", ranks=[0])
        log_dist("not here", ranks=[5])
    assert f"[Rank {rank}] hello" in caplog.text
    assert ("not here" in caplog.text) == (rank == -1)


def test_zero_names():
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    assert {s.name for s in ZeroParamStatus} == {"AVAILABLE", "NOT_AVAILABLE", "INFLIGHT"}
    lin = torch.nn.Linear(2, 2)
    deepspeed.zero.register_external_parameter(lin, lin.weight)
    with pytest.raises(RuntimeError, match="parameter must be a torch.nn.Parameter"):
        deepspeed.zero.register_external_parameter(lin, torch.ones(1))
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES, WarmupLR

    assert "WarmupDecayLR" in VALID_LR_SCHEDULES and WarmupLR is zkit.lr_schedules.warmup.WarmupLR


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_full_fp32_param_and_optimizer_state_by_parameter(stage):
    results = run_ranks(compat_ranks.full_state_by_parameter, 2, args=(stage,))
    reference = run_ranks(compat_ranks.full_state_by_parameter, 1, args=(0,))[0] if stage == 0 else None
    for r in results:
        for name, value in r["fp32"].items():
            # fp32 training: the master is the parameter; every rank sees the whole of it
            torch.testing.assert_close(value, r["gathered"][name], rtol=0, atol=0)
            assert r["exp_avg_sq"][name].shape == value.shape and (r["exp_avg_sq"][name] > 0).any()
        torch.testing.assert_close(r["after_set"], torch.full((8, 6), 0.5))
        torch.testing.assert_close(r["after_set_master"], torch.full((8, 6), 0.5))
        assert torch.equal(r["fp32"]["b.bias"], results[0]["fp32"]["b.bias"])
    if stage == 3:
        ds = [r["ds"] for r in results]
        assert all(d["numel"] == 48 and d["shape"] == (8, 6) and d["ids"] == 4 for d in ds)
        assert all(d["status"] == "NOT_AVAILABLE" and d["status_gathered"] == "AVAILABLE" for d in ds)
        assert sum(d["local"] for d in ds) == 48  # the ranks' parts of the parameter make it whole
    if reference is not None:  # the state is the optimizer's own (a 1-rank run has it whole)
        assert set(reference["exp_avg_sq"]) == set(results[0]["exp_avg_sq"])


def test_full_state_of_a_parameter_no_engine_trains():
    from deepspeed.utils import safe_get_full_fp32_param

    with pytest.raises(ValueError, match="not trained by a live zkit engine"):
        safe_get_full_fp32_param(torch.nn.Parameter(torch.ones(2)))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeeds_checkpoint_edge_cases(tmp_path, stage):
    """As DeepSpeed's TestZeROSaveLoadEdgeCase: immediate save and load, and a save before the
    accumulation of a step is done: refused, as its partial gradients would be lost (DeepSpeed saves
    and drops them on resume); training goes on and a save after the step resumes at its boundary."""
    for r in run_ranks(compat_ranks.checkpoint_edge_cases, 2, args=(str(tmp_path), stage)):
        assert r["immediate"] == 0
        assert r["boundary_before_save"] is True  # the next micro-step ends the batch
        assert r["mid_refused"].startswith("save_checkpoint during gradient accumulation: 1 of the 2 micro-batches")
        assert r["steps_after"] == 1
        assert r["loaded_micro_steps"] == 2


def test_moe_helpers_without_experts_and_refusals():
    """DeepSpeedExamples' CIFAR script imports deepspeed.moe.utils unconditionally: without
    expert parameters the groups come back as DeepSpeed returns them; experts are refused."""
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    lin = torch.nn.Linear(2, 2)
    group = {"params": list(lin.parameters()), "name": "parameters"}
    assert split(group) == [group] and split((group,)) == [group]
    with pytest.raises(ValueError, match="Unknown param group type"):
        split("params")
    lin.weight.allreduce = False  # how DeepSpeed marks an expert's parameter
    with pytest.raises(NotImplementedError, match="no mixture-of-experts"):
        split([group])
    with pytest.raises(NotImplementedError, match="MoE is not supported by zkit"):
        MoE(hidden_size=4, expert=lin, num_experts=2)


def test_initialize_engine_class_must_be_an_engine_subclass():
    with pytest.raises(TypeError, match=r"^zkit\.initialize\(engine_class=<class 'int'>\): give a subclass of "
                                        r"zkit\.core\.engine\.Engine$"):
        zkit.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_size": 1}, engine_class=int)


def test_deepspeed_only_accessors_are_on_deepspeed_engine_not_zkits():
    import zkit.core.engine

    assert issubclass(deepspeed.DeepSpeedEngine, zkit.core.engine.Engine)
    for name in ("global_rank", "local_rank", "dp_world_size", "mp_world_size", "zero_optimization",
                 "fp16_enabled", "bfloat16_enabled", "steps_per_print"):
        assert hasattr(deepspeed.DeepSpeedEngine, name) and not hasattr(zkit.core.engine.Engine, name), name
