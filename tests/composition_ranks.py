"""Rank function of the composition matrix (tests/test_composition.py)."""
from __future__ import annotations

import traceback

import torch

import composition as matrix
from composition_models import batch, build, is_pipeline, loss, named_params

STEPS = 3


def _train(engine, features: tuple[str, ...], cfg: dict, steps: range) -> None:
    micro, accum = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    replicas = matrix.replicas(features)
    replica = 0 if replicas == 1 else torch.distributed.get_rank() % replicas
    if "pipeline_dp" in features:
        replica = engine.module.grid.coord(torch.distributed.get_rank()).data
    rows = 4 // replicas
    for step in steps:
        x, y = batch(step, features)
        x = x if x.dtype == torch.long else x.to(engine.dtype)
        mine_x, mine_y = x[rows * replica: rows * (replica + 1)], y[rows * replica: rows * (replica + 1)]
        batches = [(mine_x[i:i + micro], mine_y[i:i + micro]) for i in range(0, rows, micro)]
        assert len(batches) == accum
        if is_pipeline(features):
            engine.train_batch(iter(batches))
            continue
        for xs, ys in batches:
            engine.backward(loss(engine(xs), ys))
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

    model = build(features)
    kwargs: dict = {}
    if "client_sgd" in features:
        kwargs["optimizer"] = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    stack = {"allocator": CountingAllocator.record()} if "custom_allocator" in features else {}
    if "onebit_comm" in features:
        stack["communicator"] = "onebit"
    if stack:
        kwargs["stack"] = zkit.Stack(**stack)
    engine, *_ = zkit.initialize(model=model, config=cfg, **kwargs)
    if "onebit_comm" in features:  # the cell proves nothing if the stack's choice were dropped
        from zkit_onebit import OneBitCommunicator

        assert isinstance(engine.comm, OneBitCommunicator), f"the engine reduces through {engine.comm!r}"
    if "step_in_backward" in features:  # the cell proves nothing if the key did not reach the store
        assert engine.partitioner.master_store.step_in_backward, "the master store does not step in backward"
    if "pipeline_dp" in features:
        assert engine.comm.world_size == 2, f"{engine.comm.world_size} data-parallel replicas, not 2"
    if "block_sparse" in features:  # (its reference is itself: it must be the sparse kernel)
        from zkit_sparse import SparseSelfAttention

        assert any(isinstance(m, SparseSelfAttention) for m in model.modules()), "no block-sparse attention"
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
            return {"params": named_params(model)}
        # train, save, and go on in a new engine that loads the checkpoint
        _train(engine, features, cfg, range(STEPS - 1))
        where = f"{ckpt_root}/{'-'.join(features)}"
        engine.save_checkpoint(where)
        engine.close()
        engine, model = _engine(features, cfg)
        engine.load_checkpoint(where)
        _train(engine, features, cfg, range(STEPS - 1, STEPS))
        return {"params": named_params(model)}
    except Exception:  # noqa: BLE001 - a crash after initialize is what the matrix must not have
        return {"crashed": traceback.format_exc(limit=8)}
    finally:
        engine.close()


def run_cells(cells: list[tuple[str, ...]], nvme_path: str, ckpt_root: str) -> dict:
    """Every cell (a tuple of features) in one process group, in order."""
    return {cell: _run(cell, nvme_path, ckpt_root) for cell in cells}
