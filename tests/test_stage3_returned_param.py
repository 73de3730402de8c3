"""ZeRO stage 3: a parameter a module's forward returns stays gathered for its caller (DeepSpeed's
"dangling" external parameter), and the loss equals the unpartitioned model's."""
from zkit.testing import run_ranks


def _dangling_bias() -> dict:
    import torch

    import zkit
    from zkit.zero.sharded_params import ParamStatus

    seen = []

    class ReturnsBias(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x), self.bias

    class Caller(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = torch.nn.Linear(8, 8)
            self.inner = ReturnsBias(8, 8)

        def forward(self, x):
            out, bias = self.inner(self.first(x))
            if hasattr(bias, "ds_status"):  # the engine's model, not the reference
                seen.append(bias.ds_status)
            return (out + bias).pow(2).sum()

    torch.manual_seed(0)
    model = Caller()
    reference = Caller()
    reference.load_state_dict(model.state_dict())
    config = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zkit.initialize(model=model, config=config)
    opt = torch.optim.SGD(reference.parameters(), lr=0.01)
    losses, ref_losses = [], []
    for step in range(3):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(step))
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        ref = reference(x)
        ref.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(ref.item())
    released = [p.ds_status for p in engine.module.parameters()]
    return {"seen": [s.name for s in seen], "released": [s.name for s in released], "losses": losses,
            "ref": ref_losses, "available": ParamStatus.AVAILABLE.name}


def test_returned_parameter_is_available_to_the_caller_and_released_after_forward():
    (r,) = run_ranks(_dangling_bias, 1, timeout=300)
    assert r["seen"] == [r["available"]] * 3
    assert set(r["released"]) == {"NOT_AVAILABLE"}
    assert max(abs(a - b) for a, b in zip(r["losses"], r["ref"])) < 1e-5
