"""The engine's periodic report: a per-rank memory breakdown and FLOPs per step counted by
torch's FlopCounterMode over the first training micro-step."""
from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import zkit
import zkit.activations.recompute as ckpt
from zkit.models.gpt import GPT, GPTConfig
from zkit import telemetry
from zkit.telemetry import StepProbe, format_bytes, format_flops, format_memory_line, format_step_line

from shared_models import saved_tensor_bytes

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
BATCH = 2


@pytest.fixture(autouse=True)
def _fresh_checkpointing():
    ckpt.reset()
    yield
    ckpt.reset()


def _gpt(checkpointed: bool = False) -> GPT:
    torch.manual_seed(0)
    model = GPT(CFG)
    if checkpointed:
        ckpt.apply(model, "every")
    return model


def _batch(step: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=torch.Generator().manual_seed(step))


def _reference_flops(model: torch.nn.Module) -> int:
    ids = _batch()
    with FlopCounterMode(display=False) as counter:
        model(ids, ids).backward()
    return counter.get_total_flops()


def _train(model: torch.nn.Module, stage: int = 0, steps: int = 2, gas: int = 1, every: int = 2):
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000, "stage3_param_persistence_threshold": 0},
        "steps_per_print": every,
    }
    engine, *_ = zkit.initialize(model=model, config=cfg)
    for step in range(steps * gas):
        ids = _batch(step)
        loss = engine(ids, ids)
        engine.backward(loss)
        engine.step()
    return engine


def test_log_lines_hold_the_memory_breakdown_and_flops(caplog):
    model = _gpt()
    model.register_buffer("positions", torch.arange(256, dtype=torch.float32))  # 1 KiB of buffers
    flops = _reference_flops(_gpt())
    with caplog.at_level(logging.INFO, logger="zkit"):
        engine = _train(model, stage=0)
    step_line, mem_line = [r.getMessage() for r in caplog.records if r.name == "zkit"][-2:]
    assert step_line.startswith("step 2 |")
    assert f"| {format_flops(flops)}/step |" in step_line
    assert "FLOP/s per rank" in step_line
    assert mem_line.startswith("mem r0 params ")
    for label in ("params", "grads", "optim", "buffers", "activations"):
        assert f" {label} " in mem_line, label
    mem = engine.memory()
    assert mem["grad_bytes"] == 0  # gradients are handed back after the step: the line shows their peak
    assert f"params {format_bytes(mem['param_bytes'])} grads {format_bytes(mem['grad_peak_bytes'])}" in mem_line
    assert " buffers 1 KiB " in mem_line
    assert "master" not in mem_line  # fp32 on one device: the parameters are the master
    engine.close()


@pytest.mark.parametrize("stage", (0, 3))
def test_flops_equal_flop_counter_mode_of_forward_and_backward(stage):
    engine = _train(_gpt(), stage=stage, steps=1, every=1000)
    assert telemetry.of(engine).step_probe.flops == _reference_flops(_gpt())
    metrics = telemetry.of(engine).step_probe.metrics(step_time_s=0.5, micro_steps_per_step=3)
    assert metrics == {"step_flops": 3.0 * telemetry.of(engine).step_probe.flops, "flops_per_s": 6.0 * telemetry.of(engine).step_probe.flops}
    engine.close()


def test_checkpointed_flops_include_the_recomputation():
    engine = _train(_gpt(checkpointed=True), steps=1, every=1000)
    plain = _reference_flops(_gpt())
    assert telemetry.of(engine).step_probe.flops == _reference_flops(_gpt(checkpointed=True)) > plain
    engine.close()


@pytest.mark.parametrize("checkpointed", (False, True))
def test_cpu_activation_figure_is_the_bytes_saved_for_backward(checkpointed):
    engine = _train(_gpt(checkpointed), steps=1, every=1000)
    assert telemetry.of(engine).step_probe.activation_bytes == saved_tensor_bytes(_gpt(checkpointed), _batch()) > 0
    engine.close()


def test_stage3_trains_the_same_with_the_probe_chained_to_its_hooks():
    # stage 3 gathers saved parameters again through its own saved-tensor hooks; the probe's
    # hooks run inside them and must pass every tensor on
    results = []
    for stage in (0, 3):
        engine = _train(_gpt(), stage=stage, steps=2, every=1000)
        assert telemetry.of(engine).step_probe.activation_bytes > 0
        from zkit.zero import GatheredParameters

        with GatheredParameters(list(engine.module.parameters())):
            results.append([p.detach().clone() for p in engine.module.parameters()])
        engine.close()
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*results))


def test_probe_waits_for_a_training_micro_step():
    model = torch.nn.Linear(4, 3)
    probe = StepProbe(model)
    with torch.no_grad(), probe.forward():
        model(torch.ones(2, 4))
    with probe.backward():
        pass
    assert probe.flops is None and probe.metrics(1.0, 1) == {}
    with probe.forward():
        out = model(torch.ones(2, 4)).sum()
    with probe.backward():
        out.backward()
    assert probe.flops == 2 * 2 * 4 * 3 * 2  # forward addmm + the weight's gradient mm
    with probe.forward():
        model(torch.ones(5, 4))  # later steps are not counted again
    assert probe.flops == 96


def test_format_flops():
    assert format_flops(0) == "0 FLOP"
    assert format_flops(1_500) == "1.5 KFLOP"
    assert format_flops(3.21e12) == "3.21 TFLOP"
    assert format_flops(2e21) == "2e+03 EFLOP"
    line = format_step_line(4, {"loss": 1.0, "step_flops": 2e9, "flops_per_s": 4e10})
    assert line == "step 4 | loss 1 | 2 GFLOP/step | 40 GFLOP/s per rank"


def test_memory_line_per_rank_and_compact():
    ranks = [
        {"param_bytes": 2 << 20, "grad_peak_bytes": 1 << 20, "optim_state_bytes": 0, "activations_peak_bytes": 3 << 20},
        {"param_bytes": 2 << 20, "grad_peak_bytes": 5 << 20, "buffers_bytes": 512},
    ]
    assert format_memory_line(ranks) == (
        "mem r0 params 2 MiB grads 1 MiB activations 3 MiB | r1 params 2 MiB grads 5 MiB buffers 512 B"
    )
    many = ranks + [{"param_bytes": 1 << 20}] * 4
    assert format_memory_line(many) == (
        "mem r0 params 2 MiB grads 1 MiB activations 3 MiB | max over 6 ranks params 2 MiB (r0) "
        "grads 5 MiB (r1) buffers 512 B (r1) activations 3 MiB (r0)"
    )
