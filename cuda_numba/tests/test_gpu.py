"""On a CUDA machine: the kernels through SparseSelfAttention equal the PyTorch path, and the
engine steps a config's "fused_adam_cuda" with the fused Adam kernel as torch's Adam would."""
from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block", [16, 32, 64])
def test_kernels_match_torch_path(dtype, block):
    from zkit_sparse import BigBirdSparsityConfig, SparseSelfAttention

    cfg = BigBirdSparsityConfig(4, block=block, num_random_blocks=2)
    kernel = SparseSelfAttention(cfg, max_seq_length=1024, use_kernels=True)
    torch_path = SparseSelfAttention(cfg, max_seq_length=1024, use_kernels=False)
    q, k, v = (torch.randn(2, 4, 1024, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    kp = torch.zeros(2, 1024, device="cuda")
    kp[1, 900:] = float("-inf")
    out = kernel(q, k, v, key_padding_mask=kp)
    ref = torch_path(q, k, v, key_padding_mask=kp)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a.float(), b.float(), atol=10 * tol, rtol=10 * tol)


def test_fused_adam_matches_torch_on_gpu():
    from zkit_cuda_numba.fused_adam import FusedAdamCUDA

    p = torch.randn(1 << 20, device="cuda", requires_grad=True)
    q = p.detach().clone().requires_grad_()
    opt, ref = FusedAdamCUDA([p], lr=1e-3, weight_decay=0.01), torch.optim.AdamW([q], lr=1e-3, weight_decay=0.01)
    for _ in range(3):
        g = torch.randn_like(p)
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("stage, dtype", [(1, "fp32"), (2, "fp16"), (2, "bf16")])
def test_engine_steps_fused_adam_with_the_kernel_on_gpu(stage, dtype):
    """The config type fused_adam_cuda picks the kernel on cuda; "FusedAdam" is torch's fused Adam."""
    import zkit
    from zkit_cuda_numba.fused_adam import FusedAdamCUDA

    def train(optimizer_type):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
        cfg = {"train_batch_size": 8, "gradient_clipping": 0.05, "zero_optimization": {"stage": stage},
               "optimizer": {"type": optimizer_type, "params": {"lr": 1e-2, "weight_decay": 0.1}}}
        if dtype != "fp32":
            cfg[dtype] = {"enabled": True}
        engine, *_ = zkit.initialize(model=model, config=cfg)
        for step in range(3):
            x = torch.randn(8, 64, device=engine.device, generator=torch.Generator(engine.device).manual_seed(step))
            engine.backward(engine(x.to(engine.dtype)).float().square().mean())
            engine.step()
        return engine

    ours, ref = train("fused_adam_cuda"), train("FusedAdam")
    assert isinstance(ours.optimizer, FusedAdamCUDA) and ref.records["optimizer"].name == "adam"  # torch's
    tol = 1e-5 if dtype == "fp32" else 1e-2
    for p, q in zip(ours.module.parameters(), ref.module.parameters()):
        torch.testing.assert_close(p.float(), q.float(), atol=tol, rtol=tol)
