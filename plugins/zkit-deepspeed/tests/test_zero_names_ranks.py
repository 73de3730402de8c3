"""On 2 gloo ranks through ``deepspeed.initialize``: ``safe_get_full_grad`` gives the data-parallel
mean gradient of plain PyTorch (stages 2 and 3), a ZeRO-3 parameter a forward returns is available
to its caller and recorded in its ``_external_params`` as DeepSpeed does, and
``unwrap_model_for_generation`` gathers every parameter for its block."""
from __future__ import annotations

from zkit.testing import run_ranks


def _build():
    import torch

    class ReturnsBias(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x), self.bias

    class Caller(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = ReturnsBias(6, 6)
            self.seen: list = []

        def forward(self, x):
            out, bias = self.inner(x)
            if hasattr(bias, "ds_status"):
                self.seen.append((bias.ds_status.name, len(self._external_params),
                                  len(self.inner._external_params)))
            return (out + bias).pow(2).mean()

    class Top(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = torch.nn.Linear(6, 6)
            self.caller = Caller()

        def forward(self, x):
            return self.caller(self.first(x))

    torch.manual_seed(0)
    return Top()


def _rank() -> dict:
    import torch
    import torch.distributed as dist

    import deepspeed
    from deepspeed.runtime.zero import unwrap_model_for_generation
    from deepspeed.utils import safe_get_full_grad

    rank, world = dist.get_rank(), dist.get_world_size()
    xs = [torch.randn(3, 6, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    reference = _build()
    for x in xs:
        (reference(x) / world).backward()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
    out: dict = {}
    for stage in (2, 3):
        model = _build()
        config = {"train_batch_size": 3 * world, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.backward(engine(xs[rank]))
        grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
        out[stage] = max((grads[n].reshape(g.shape) - g).abs().max().item() for n, g in ref_grads.items())
        engine.step()
        if stage == 3:
            out["seen"] = engine.module.caller.seen
            out["external"] = len(engine.module.caller._external_params)
            with unwrap_model_for_generation(engine) as unwrapped:
                out["gathered"] = sorted({p.ds_status.name for p in unwrapped.module.parameters()})
            out["after"] = sorted({p.ds_status.name for p in engine.module.parameters()})
    return out


def test_full_grad_returned_parameter_and_unwrap_on_two_ranks():
    results = run_ranks(_rank, 2, timeout=600)
    for r in results:
        assert r[2] < 1e-6 and r[3] < 1e-6, r
        # in Caller.forward: available, registered on Caller (not on inner, the caller covers it)
        assert r["seen"] == [("AVAILABLE", 1, 0)] and r["external"] == 1
        assert r["gathered"] == ["AVAILABLE"] and r["after"] == ["NOT_AVAILABLE"]
