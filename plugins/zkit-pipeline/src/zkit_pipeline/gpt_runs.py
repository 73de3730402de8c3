"""The small GPT (:mod:`zkit_pipeline.tp_gpt`) trained through ``zkit.initialize`` on a process
grid, next to the same model trained densely in one process on the same global batches. The tests
and ``contrib/bench/bench_pipeline_3d.py`` call these inside their ranks::

    dense = train_dense(cfg, data)                      # every rank, alone
    pipe = train_pipeline(cfg, data, stages=2)         # 2 pipe x (world / 2) data
    tensor = train_tensor_parallel(cfg, data, tensor=2) # 2 tensor x (world / 2) data

``data[step][replica][micro]`` is an ``(inputs, targets)`` pair; a run returns, per step, the mean
loss of this rank's replica, the global gradient norm and the engine (to save, load or close).
"""
from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.distributed as dist

from zkit_pipeline.module import PipelineModule
from zkit_pipeline.tensor_parallel.module import TensorParallelModule
from zkit_pipeline.topology import ProcessGrid
from zkit_pipeline.tp_gpt import TensorParallelGPTConfig, TensorParallelGPT, lm_loss, pipeline_layers

Batches = list[list[list[tuple[torch.Tensor, torch.Tensor]]]]


@attrs.frozen
class Run:
    losses: list[float]
    grad_norms: list[float | None]
    engine: Any = None


def make_data(cfg: TensorParallelGPTConfig, steps: int, replicas: int, micro: int, batch: int, seed: int = 7,
              progressions: bool = False) -> Batches:
    """``[step][replica][micro] -> (inputs, targets)``: random tokens, or with ``progressions``
    arithmetic progressions ``a + k t (mod vocab)`` (learnable, so losses fall)."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(cfg.seq_len + 1, device="cpu")

    def sample() -> torch.Tensor:
        if not progressions:
            return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen, device="cpu")
        a = torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen, device="cpu")
        k = torch.randint(1, 4, (batch, 1), generator=gen, device="cpu")
        return (a + k * t) % cfg.vocab_size

    out: Batches = []
    for _ in range(steps):
        step = []
        for _ in range(replicas):
            ids = [sample() for _ in range(micro)]
            step.append([(x[:, :-1], x[:, 1:]) for x in ids])
        out.append(step)
    return out


def engine_config(micro: int, batch: int, zero: int, lr: float, clip: float) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": micro,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr}},
        "zero_optimization": {"stage": zero, "reduce_bucket_size": 4096},
    }


def train_dense(cfg: TensorParallelGPTConfig, data: Batches, *, lr: float, clip: float, replica: int | None = 0) -> Run:
    """The reference: one process, the whole global batch, AdamW, ``clip_grad_norm_``. The losses
    are ``replica``'s, or with ``None`` the mean over the replicas (what a pipeline engine's
    ``train_batch`` returns)."""
    model = TensorParallelGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)  # zkit's AdamW default
    losses, norms = [], []
    for step in data:
        n = sum(len(r) for r in step)
        mine = 0.0
        for r, batches in enumerate(step):
            for x, y in batches:
                loss = model.loss(model(x), y)
                (loss / n).backward()
                if replica is None or r == replica:
                    mine += loss.item() / len(batches) / (len(step) if replica is None else 1)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(mine)
    return Run(losses, norms)


def train_pipeline(cfg: TensorParallelGPTConfig, data: Batches, *, stages: int, zero: int, lr: float, clip: float,
                   schedule: str = "1f1b") -> Run:
    """``stages`` pipeline stages x the rest data parallel, through ``engine.train_batch``."""
    import zkit

    module = PipelineModule(pipeline_layers(cfg), stages, lm_loss, partition_method="uniform", schedule=schedule)
    micro, batch = len(data[0][0]), data[0][0][0][0].shape[0]
    engine, *_ = zkit.initialize(model=module, config=engine_config(micro, batch, zero, lr, clip))
    engine.track_grad_norm = True
    replica = module.grid.coord(dist.get_rank()).data
    losses, norms = [], []
    for step in data:
        losses.append(float(engine.train_batch(iter(step[replica]))))
        norms.append(engine.get_global_grad_norm())
    return Run(losses, norms, engine)


def tensor_parallel_engine(cfg: TensorParallelGPTConfig, *, tensor: int, zero: int, lr: float, clip: float, micro: int,
                           batch: int) -> tuple[Any, int]:
    """A ``tensor`` x (world / tensor) engine of the GPT; returns it and this rank's replica."""
    import zkit

    grid = ProcessGrid(data=dist.get_world_size() // tensor, tensor=tensor)
    module = TensorParallelModule(lambda tp: TensorParallelGPT(cfg, tp), grid)
    engine, *_ = zkit.initialize(model=module, config=engine_config(micro, batch, zero, lr, clip))
    engine.track_grad_norm = True
    return engine, module.coord.data


def train_steps(engine: Any, data: Batches, replica: int) -> Run:
    """forward / backward / step of a :class:`TensorParallelModule` engine over ``data``."""
    gpt = engine.module.module
    losses, norms = [], []
    for step in data:
        total = 0.0
        for x, y in step[replica]:
            loss = gpt.loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / len(step[replica]))
        norms.append(engine.get_global_grad_norm())
    return Run(losses, norms, engine)


def train_tensor_parallel(cfg: TensorParallelGPTConfig, data: Batches, *, tensor: int, zero: int, lr: float, clip: float) -> Run:
    """``tensor`` tensor-parallel ranks x the rest data parallel, through the engine's ordinary
    forward / backward / step."""
    micro, batch = len(data[0][0]), data[0][0][0][0].shape[0]
    engine, replica = tensor_parallel_engine(cfg, tensor=tensor, zero=zero, lr=lr, clip=clip, micro=micro, batch=batch)
    return train_steps(engine, data, replica)
