"""What DeepSpeed applications (DeepSpeed-Chat's training scripts) rely on beyond importable names:
the module helpers they import, the engine answering for the module it wraps and its
``tput_timer``, ``offload_param`` ignored below stage 3 as DeepSpeed ignores it,
``DeepSpeedCPUAdam`` over bf16 parameters, and ``Module.to`` on a ZeRO-3-partitioned module."""
from __future__ import annotations

import importlib
import sys
import warnings

import pytest
import torch

from deepspeed.refused import FeatureNotProvided
from zkit.testing import run_ranks


def test_module_helpers_where_deepspeed_chat_imports_them():
    sys.modules.pop("deepspeed.compression.helper", None)
    with pytest.warns(FutureWarning, match="import recursive_getattr and recursive_setattr from "
                                           "deepspeed.utils.module_utils"):
        helper = importlib.import_module("deepspeed.compression.helper")
    from deepspeed.utils import module_utils, recursive_getattr

    assert helper.recursive_getattr is module_utils.recursive_getattr is recursive_getattr
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.ReLU())
    assert helper.recursive_getattr(model, "0.0") is model[0][0]
    assert helper.recursive_getattr(model, "0.0.weight") is model[0][0].weight
    replacement = torch.nn.Linear(2, 3)
    helper.recursive_setattr(model, "0.0", replacement)
    assert model[0][0] is replacement and dict(model.named_modules())["0.0"] is replacement
    helper.recursive_setattr(model, "1", torch.nn.Tanh())  # a top-level name
    assert isinstance(model[1], torch.nn.Tanh)
    with pytest.raises(AttributeError):
        helper.recursive_getattr(model, "0.missing")
    # the compression library beside them stays refused, with its message
    with pytest.raises(FeatureNotProvided, match=r"deepspeed.compression.helper.convert_conv1d_to_linear \(DeepSpeed "
                                                 r"Compression"):
        helper.convert_conv1d_to_linear  # noqa: B018
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(FeatureNotProvided, match="deepspeed.compression.compress"):
            importlib.import_module("deepspeed.compression.compress")


class _Wrapped(torch.nn.Module):
    """A Hugging Face-like model: an inner ``model`` and methods of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Linear(4, 4)
        self.checkpointing = False
        self.label = "mine"

    def gradient_checkpointing_enable(self) -> str:
        self.checkpointing = True
        return "enabled"

    def forward(self, x):
        return self.model(x).pow(2).mean()


def _engine_rank() -> dict:
    import deepspeed

    torch.manual_seed(0)
    module = _Wrapped()
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 100,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = deepspeed.initialize(model=module, config=config)
    out = {
        "model": engine.model is module.model,
        "method": engine.gradient_checkpointing_enable(),
        "flag": module.checkpointing and engine.checkpointing,
        "label": engine.label,
        # the engine's own names come first
        "module": engine.module is module,
        "batch": engine.train_batch_size(),
    }
    try:
        engine.no_such_thing  # noqa: B018
    except AttributeError as exc:
        out["missing"] = str(exc)
    timer = engine.tput_timer
    out["timer_is_kept"] = timer is engine.tput_timer
    for _ in range(3):  # 1.5 batches: 3 micro-steps, 1 optimizer step
        engine.backward(engine(torch.randn(2, 4)))
        engine.step()
    out["counts"] = (timer.epoch_count, timer.micro_step_count, timer.global_step_count, timer.batch_size)
    timer.update_epoch_count()
    engine.backward(engine(torch.randn(2, 4)))
    engine.step()
    out["after_epoch"] = (timer.epoch_count, timer.micro_step_count, timer.global_step_count)
    out["samples_per_s"] = timer.avg_samples_per_sec()
    return out


def test_engine_answers_for_its_module_and_keeps_deepspeeds_throughput_counters():
    (r,) = run_ranks(_engine_rank, 1, timeout=300)
    assert r["model"] and r["method"] == "enabled" and r["flag"] and r["label"] == "mine"
    assert r["module"] and r["batch"] == 4
    assert r["missing"] == ("'DeepSpeedEngine' object has no attribute 'no_such_thing', nor has the module it wraps "
                            "(_Wrapped)")
    assert r["timer_is_kept"]
    assert r["counts"] == (0, 3, 1, 4)
    assert r["after_epoch"] == (1, 1, 2)
    assert r["samples_per_s"] > 0


def _offload_param_rank(with_key: bool) -> dict:
    import logging

    import deepspeed

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("zkit").addHandler(Keep())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    if with_key:
        zero["offload_param"] = {"device": "cpu"}
    config = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
              "zero_optimization": zero}
    losses = []
    for repeat in range(2):  # the second engine of the process warns no more
        engine, *_ = deepspeed.initialize(model=model if repeat == 0 else _copy(model), config=config)
        if repeat == 0:
            gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
            for _ in range(3):
                loss = engine(torch.randn(2, 6, generator=gen)).pow(2).mean()
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
    return {"losses": losses, "warnings": [m for m in records if "offload_param" in m]}


def _copy(model):
    import copy

    return copy.deepcopy(model)


def test_offload_param_below_stage_3_is_ignored_with_one_warning_as_deepspeed_does():
    with_key = run_ranks(_offload_param_rank, 2, args=(True,), timeout=300)
    without = run_ranks(_offload_param_rank, 2, args=(False,), timeout=300)
    for a, b in zip(with_key, without):
        assert a["losses"] == b["losses"]  # bit-equal, as DeepSpeed's
        assert b["warnings"] == []
    assert with_key[0]["warnings"] == [
        "config key 'zero_optimization.offload_param' (device 'cpu') has no effect at ZeRO stage 2: DeepSpeed "
        "offloads parameters only at stage 3 and ignores the key below it, and so does this drop-in; remove it, or "
        "set zero_optimization.stage to 3"
    ]


def test_zkits_own_initialize_still_refuses_offload_param_below_stage_3():
    from zkit_offload.plugin import choose_stack
    from zkit_offload.config import OffloadParamConfig

    with pytest.raises(ValueError, match="needs ZeRO stage 3"):
        choose_stack(None, None, None, OffloadParamConfig(device="cpu"), 2)


def test_cpu_adam_takes_bf16_parameters_and_steps_them_as_deepspeeds_kernel():
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    torch.manual_seed(0)
    half = torch.nn.Parameter(torch.randn(37).to(torch.bfloat16))
    full = torch.nn.Parameter(half.detach().float())
    opt_half = DeepSpeedCPUAdam([half], lr=0.01, weight_decay=0.1)  # refused before: "steps fp32 parameters"
    opt_full = DeepSpeedCPUAdam([full], lr=0.01, weight_decay=0.1)
    for _ in range(3):
        grad = torch.randn(37).to(torch.bfloat16)
        half.grad, full.grad = grad.clone(), grad.float()
        opt_half.step()
        opt_full.step()
        # DeepSpeed's kernel: the bf16 value read in fp32, stepped with fp32 state, written back rounded
        assert half.dtype == torch.bfloat16 and half.grad.dtype == torch.bfloat16
        assert torch.equal(half.detach(), full.detach().to(torch.bfloat16))
        full.data.copy_(half.detach().float())
    assert opt_half.state[half]["exp_avg"].dtype == torch.float32
    assert torch.equal(opt_half.state[half]["exp_avg_sq"], opt_full.state[full]["exp_avg_sq"])


def _cpu_adam_zero3_bf16_rank(client: bool) -> list[float]:
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    config = {"train_batch_size": 4, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                    "stage3_param_persistence_threshold": 0}}
    if not client:
        config["optimizer"] = {"type": "Adam", "params": {"lr": 0.01, "betas": [0.9, 0.95]}}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # before any optimizer exists
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=0.01, betas=(0.9, 0.95)) if client else None
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    losses = []
    for _ in range(3):
        loss = engine(torch.randn(2, 8, generator=gen).to(torch.bfloat16)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_cpu_adam_over_bf16_zero_init_parameters_trains_as_the_configs_cpu_adam():
    client = run_ranks(_cpu_adam_zero3_bf16_rank, 2, args=(True,), timeout=300)
    configured = run_ranks(_cpu_adam_zero3_bf16_rank, 2, args=(False,), timeout=300)
    assert client == configured


def _to_rank() -> dict:
    import deepspeed

    out: dict = {}
    config = {"train_batch_size": 4, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    weight = model[0].weight
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # no-op moves outside GatheredParameters pass, gathering nothing (DeepSpeed-Chat's LoRA layers)
    model.to(weight.device).to(weight.dtype)
    model.float().cpu()
    out["noop_kept_partitioned"] = weight.ds_status.name
    out["same_object"] = weight.to(torch.float32) is weight
    try:  # one tensor's real conversion needs its values: still the error that says how
        weight.to(torch.bfloat16)
    except RuntimeError as exc:
        out["single"] = str(exc)
    # a real change of the module applies to the partitions
    model.to(torch.bfloat16)
    out["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    out["status"] = weight.ds_status.name
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        out["values"] = all(torch.equal(p.detach(), before[n].to(torch.bfloat16)) for n, p in model.named_parameters())
    out["shard_dtype"] = str(weight.ds_tensor.dtype)
    engine, *_ = deepspeed.initialize(model=model, config={**config, "bf16": {"enabled": True},
                                                           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.module.to(torch.bfloat16)  # a no-op under the engine too
    try:
        engine.module.to(torch.float16)
    except RuntimeError as exc:
        out["engine"] = str(exc)
    return out


def test_module_to_on_a_zero3_partitioned_module():
    for r in run_ranks(_to_rank, 2, timeout=300):
        assert r["noop_kept_partitioned"] == "NOT_AVAILABLE" and r["same_object"]
        assert r["single"].startswith("parameter 'weight' (shape (64, 64)) is partitioned by ZeRO stage 3 and not "
                                      "gathered here")
        assert r["dtypes"] == ["torch.bfloat16"] and r["status"] == "NOT_AVAILABLE"
        assert r["values"] and r["shard_dtype"] == "torch.bfloat16"
        assert r["engine"].startswith("module '0': its parameters are partitioned by a ZeRO stage 3 engine, "
                                      "which keeps them in torch.bfloat16 where its config puts them; converting them "
                                      "to torch.float16 after initialize is not supported")


class _Tied(torch.nn.Module):
    """Tied weights, a frozen layer, a persistent and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.frozen = torch.nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.last = torch.nn.Linear(4, 4)
        self.last.weight = self.first.weight
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("scratch", torch.zeros(4), persistent=False)

    def forward(self, x):
        return self.last(self.frozen(self.first(x)) * self.scale)


def _save_rank(folder: str) -> dict:
    import deepspeed

    out = {}
    for stage in (0, 2):
        torch.manual_seed(0)
        config = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                  "zero_optimization": {"stage": stage}}
        engine, *_ = deepspeed.initialize(model=_Tied(), config=config)
        engine.backward(engine(torch.randn(2, 4)).sum())
        engine.step()
        engine.save_checkpoint(f"{folder}/stage{stage}", client_state={"mine": 1})
        out[stage] = {n: t.detach().clone() for n, t in engine.module.state_dict().items()}
        _, client = engine.load_checkpoint(f"{folder}/stage{stage}")
        out[f"client{stage}"] = client
    return out


def test_load_checkpoint_returns_deepspeeds_keys_beside_the_client_state():
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        out = run_ranks(_save_rank, 2, args=(folder,), timeout=300)[0]
    stage0, stage2 = out["client0"], out["client2"]
    for client in (stage0, stage2):
        assert client["mine"] == 1 and client["buffer_names"] == ["scale"]
        assert client["ds_version"].endswith("+zkit") and client["ds_config"]["zero_optimization"]["stage"] in (0, 2)
    # DeepSpeed writes None for these without ZeRO optimizer state
    assert stage0["param_shapes"] is stage0["shared_params"] is stage0["frozen_param_shapes"] is None
    assert stage2["param_shapes"] == [{"first.weight": torch.Size([4, 4]), "first.bias": torch.Size([4]),
                                       "last.bias": torch.Size([4])}]
    assert stage2["shared_params"] == {"last.weight": "first.weight"}
    assert stage2["frozen_param_shapes"] == {"frozen.weight": torch.Size([4, 4]), "frozen.bias": torch.Size([4])}


def test_a_zero_checkpoint_folder_holds_zero_to_fp32_py_as_deepspeeds_does(tmp_path):
    import os
    import subprocess

    weights = run_ranks(_save_rank, 2, args=(str(tmp_path),), timeout=300)[0]
    assert not (tmp_path / "stage0" / "zero_to_fp32.py").exists()  # DeepSpeed copies it for ZeRO checkpoints
    script = tmp_path / "stage2" / "zero_to_fp32.py"
    assert os.access(script, os.X_OK)
    # run as users run DeepSpeed's: from anywhere, the folder and an output folder as arguments
    proc = subprocess.run([sys.executable, str(script), str(script.parent), str(tmp_path / "out")], cwd="/",
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    state = torch.load(tmp_path / "out" / "pytorch_model.bin")
    assert state.keys() == weights[2].keys()
    assert all(torch.equal(state[n], w) for n, w in weights[2].items())
