"""Rank function of the composition matrix (tests/test_composition.py)."""
from __future__ import annotations

import traceback

import torch

import composition as matrix

STEPS = 3


class Residual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(h)


def layers() -> list[torch.nn.Module]:
    """The model as a layer list (the same weights whether it is split into stages or not)."""
    torch.manual_seed(0)
    return [torch.nn.Linear(8, 16), Residual(), Residual(), torch.nn.Linear(16, 4)]


class Net(torch.nn.Module):
    """The layers in order; with ``ckpt`` each residual block runs through zkit.checkpointing."""

    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers())
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from zkit import checkpointing

        for layer in self.layers:
            x = checkpointing.checkpoint(layer, x) if self.ckpt and isinstance(layer, Residual) else layer(x)
        return x


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).pow(2).mean()


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: 2 rows per data-parallel rank of the 2-rank reference."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _model(features: tuple[str, ...]) -> torch.nn.Module:
    if "pipeline" not in features:
        return Net(ckpt="act_ckpt" in features)
    from zkit_pipeline import PipelineModule

    return PipelineModule(layers(), num_stages=2, loss_fn=_mse, partition_method="uniform",
                          activation_checkpoint_interval=1 if "act_ckpt" in features else 0)


def _named_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters under the plain model's names (``layers.<global index>....``)."""
    from zkit.zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        if hasattr(model, "layer_range"):  # a pipeline stage: chunks.0.<local index>....
            start, _ = model.layer_range(0)
            out = {}
            for name, p in model.named_parameters():
                _, _, local, rest = name.split(".", 3)
                out[f"layers.{start + int(local)}.{rest}"] = p.detach().float().clone()
            return out
        return {name: p.detach().float().clone() for name, p in model.named_parameters()}


def _train(engine, features: tuple[str, ...], cfg: dict, steps: range) -> None:
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    micro, accum = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    dtype = engine.dtype
    for step in steps:
        x, y = _batch(step, world)
        if "pipeline" in features:  # one replica: the whole global batch in micro-batches
            batches = [(x[i:i + micro].to(dtype), y[i:i + micro]) for i in range(0, 4, micro)]
            engine.train_batch(iter(batches))
            continue
        mine_x, mine_y = x[2 * rank: 2 * rank + 2], y[2 * rank: 2 * rank + 2]
        for m in range(accum):
            xs, ys = mine_x[m * micro:(m + 1) * micro], mine_y[m * micro:(m + 1) * micro]
            engine.backward(_mse(engine(xs.to(dtype)), ys))
            engine.step()


class CountingAllocator:
    """A third-party allocator: zkit's flat device buffers, counting what it hands out."""

    @staticmethod
    def record():
        from zkit.alloc import Allocator
        from zkit.records import AllocatorRecord

        class Counting(Allocator):
            handed_out = 0

            def place(self, purpose: str) -> torch.device:
                return self.device

            def empty(self, numel: int, dtype: torch.dtype, purpose: str) -> torch.Tensor:
                Counting.handed_out += 1
                return super().empty(numel, dtype, purpose)

        return AllocatorRecord(name="counting", factory=lambda device, config: Counting(device), dist="third-party")


def _engine(features: tuple[str, ...], cfg: dict):
    import zkit

    model = _model(features)
    kwargs = {}
    if "client_sgd" in features:
        kwargs["optimizer"] = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    if "custom_allocator" in features:
        kwargs["stack"] = zkit.Stack(allocator=CountingAllocator.record())
    engine, *_ = zkit.initialize(model=model, config=cfg, **kwargs)
    return engine, model


def _run(features: tuple[str, ...], nvme_path: str, ckpt_root: str) -> dict:
    cfg = matrix.config(features, nvme_path)
    try:
        engine, model = _engine(features, cfg)
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return {"refused": f"{type(exc).__name__}: {exc}"}
    try:
        if "save_load" not in features:
            _train(engine, features, cfg, range(STEPS))
            return {"params": _named_params(model)}
        # train, save, and go on in a new engine that loads the checkpoint
        _train(engine, features, cfg, range(STEPS - 1))
        where = f"{ckpt_root}/{'-'.join(features)}"
        engine.save_checkpoint(where)
        engine.close()
        engine, model = _engine(features, cfg)
        engine.load_checkpoint(where)
        _train(engine, features, cfg, range(STEPS - 1, STEPS))
        return {"params": _named_params(model)}
    except Exception:  # noqa: BLE001 - a crash after initialize is what the matrix must not have
        return {"crashed": traceback.format_exc(limit=8)}
    finally:
        engine.close()


def run_cells(cells: list[tuple[str, ...]], nvme_path: str, ckpt_root: str) -> dict:
    """Every cell (a tuple of features) in one process group, in order."""
    return {cell: _run(cell, nvme_path, ckpt_root) for cell in cells}
