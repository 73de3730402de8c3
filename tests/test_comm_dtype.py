"""communication_data_type: gradients reduced in another dtype than the training dtype. The
reduced values are the communication dtype's; they accumulate over micro-steps in the training
dtype unless data_types.grad_accum_dtype says otherwise (DeepSpeed's default is the model dtype)."""
from __future__ import annotations

import pytest
import torch

import zkit


def _engine(stage: int, **extra):
    torch.manual_seed(0)
    return zkit.initialize(model=torch.nn.Linear(4, 1, bias=False), config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4, "communication_data_type": "bf16",
        "zero_optimization": {"stage": stage}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "steps_per_print": 1000, **extra})[0]


@pytest.mark.parametrize("stage", [2, 3])
def test_fp32_training_reduces_in_bf16_and_accumulates_in_fp32(stage):
    """Each micro-step's gradient is rounded to bf16 by the reduction; the shards add them in fp32
    (a bf16 shard rounded after each add, and the fp32 master refused it as its .grad at the step)."""
    engine = _engine(stage)
    before = next(engine.module.parameters()).detach().clone()
    micro = []
    for i in range(4):
        x = torch.full((1, 4), 1.0 + i / 3)
        engine.backward(engine(x).sum() * 1000, scale_wrt_gas=False)
        micro.append((x * 1000).to(torch.bfloat16).float().reshape(-1))
        if i < 3:
            engine.step()
    shard = engine.partitioner.grad_shards[0]
    assert engine.partitioner.comm_dtype == torch.bfloat16
    assert shard.dtype == torch.float32
    assert torch.equal(shard[:4], sum(micro))
    engine.step()
    moved = (before - engine.module.weight.detach()).reshape(-1)  # the step took the fp32 sum
    torch.testing.assert_close(moved, 0.1 * sum(micro), rtol=1e-6, atol=0)


def test_fp32_accumulation_beside_bf16_reductions_is_accepted_at_stage_1():
    """Stages 0-1 accumulate in the parameters' own .grad, fp32 here: grad_accum_dtype fp32 is that
    dtype, whatever the communication dtype (it was refused, naming bfloat16 gradients)."""
    engine = _engine(1, data_types={"grad_accum_dtype": "fp32"})
    engine.backward(engine(torch.ones(1, 4)).sum())
    assert next(engine.module.parameters()).grad.dtype == torch.float32


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("comm", [None, "bf16"])
def test_fp32_training_accumulates_in_bf16_when_grad_accum_dtype_says_so(stage, comm):
    """fp32 training with data_types.grad_accum_dtype bf16: the reduced shards add the micro-steps
    in bf16 (rounded after each add) and the fp32 step takes that sum (the fp32 parameters, which
    are the master there, refused the bf16 shard as their .grad at the first step)."""
    torch.manual_seed(0)
    engine = zkit.initialize(model=torch.nn.Linear(4, 1, bias=False), config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": stage},
        "data_types": {"grad_accum_dtype": "bf16"}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "steps_per_print": 1000, **({"communication_data_type": comm} if comm else {})})[0]
    before = next(engine.module.parameters()).detach().clone()
    total = None
    for i in range(4):
        x = torch.full((1, 4), 1.0 + i / 3)
        engine.backward(engine(x).sum() * 1000, scale_wrt_gas=False)
        grad = (x * 1000).reshape(-1)
        grad = grad.to(torch.bfloat16).float() if comm else grad  # what the reduction gives
        total = (grad if total is None else total.float() + grad).to(torch.bfloat16)
        if i < 3:
            engine.step()
    shard = engine.partitioner.grad_shards[0]
    assert shard.dtype == torch.bfloat16
    assert torch.equal(shard[:4], total)
    engine.step()
    moved = (before - engine.module.weight.detach()).reshape(-1)
    torch.testing.assert_close(moved, 0.1 * total.float(), rtol=1e-6, atol=0)
