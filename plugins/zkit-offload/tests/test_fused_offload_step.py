"""The engine's CPU-offloaded step is one fused pass: the gradient factor (unscale x clip), the
Adam update and the 16-bit copy-out into the parameters, with the same result as the separate
passes of the same engine without offload (scale the gradients, torch's AdamW, copy the master
into the parameters)."""
from __future__ import annotations

import pytest
import torch

import zkit


def _run(stage: int, dtype: str, optimizer: str, clip: float, offload: bool = True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": clip, "steps_per_print": 1000,
           "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu" if offload else "none"}},
           "optimizer": {"type": optimizer, "params": {"lr": 1e-2, "weight_decay": 0.01}},
           dtype: {"enabled": True, **({"initial_scale_power": 4} if dtype == "fp16" else {})}}
    engine, *_ = zkit.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 16, generator=g).to(engine.dtype)
        loss = engine(x).float().pow(2).mean() * 100
        engine.backward(loss)
        engine.step()
    with zkit.zero.GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().float().clone() for p in engine.module.parameters()]
    masters = [m.clone() for m in engine.partitioner.master]
    kernel, copy_out = engine.partitioner.step_kernel(), engine.partitioner.copy_out
    engine.close()
    return params, masters, kernel, copy_out


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_offloaded_step_is_one_fused_pass_with_the_separate_passes_result(stage, dtype):
    params, masters, kernel, copy_out = _run(stage, dtype, "cpu_adamw", clip=0.5)
    assert copy_out, "the step should write the 16-bit parameters itself"
    out = "bfloat16" if dtype == "bf16" else "float16"
    assert kernel == f"CPUAdamW: Numba fused pass (gradient x {kernel.split('gradient x ')[1].split(',')[0]}, CPUAdamW update, {out} copy-out)"
    # the same engine without offload: scaled gradients, torch's AdamW, then the master copied out
    ref_params, ref_masters, ref_kernel, ref_copy_out = _run(stage, dtype, "adamw", clip=0.5, offload=False)
    assert not ref_copy_out and ref_kernel.startswith("AdamW.step")
    assert ref_kernel.endswith(", then the master copied into the parameters)"), ref_kernel
    for a, b in zip(masters, ref_masters):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(params, ref_params):  # the 16-bit weights: the same rounding of those masters
        torch.testing.assert_close(a, b, rtol=0, atol=float(torch.finfo(torch.bfloat16).eps) * 4)
