"""Rank function of test_grid_norm_offload.py: a tensor-parallel model whose optimizer state is on
NVMe, with gradient clipping or fp16 (both need the grid-wide gradient norm)."""
from __future__ import annotations

import composition as matrix
from composition_models import batch, build, loss


def tensor_parallel_nvme(features: tuple[str, ...], nvme_path: str, track_after_init: bool = False) -> dict:
    import zkit

    features = ("nvme_offload", "tensor_parallel", *features)
    cfg = matrix.config(features, nvme_path)
    try:
        engine, *_ = zkit.initialize(model=build(features), config=cfg)
    except ValueError as exc:
        return {"refused": str(exc)}
    engine.track_grad_norm = track_after_init  # asked for after initialize: nothing refused it there
    x, y = batch(0, features)
    for i in range(0, 4, cfg["train_micro_batch_size_per_gpu"]):
        engine.backward(loss(engine(x[i:i + 2].to(engine.dtype)), y[i:i + 2]))
        try:
            engine.step()
        except RuntimeError as exc:
            return {"stopped": str(exc)}
    engine.close()
    return {"trained": engine.global_steps}
