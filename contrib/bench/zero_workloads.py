"""What every contestant of the ZeRO benchmark trains, and how a step is timed.

This module is imported on both sides of the benchmark: by zkit's own interpreter and by the
interpreter DeepSpeed lives in. It depends on torch and :mod:`zkit.models.gpt` only, so every
contestant trains the same model from the same seed on the same token batches, with the same
optimizer hyper-parameters and the same bucket size.
"""
from __future__ import annotations

import os
import resource
import statistics
import threading
import time
from typing import Any, Callable

import attrs
import torch
import torch.distributed as dist

from zkit.models.gpt import GPT, GPTConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


@attrs.frozen(kw_only=True)
class Workload:
    """One benchmark case: a GPT shape, a precision and a batch. Plain values only, so it pickles
    into rank processes and travels as JSON to the DeepSpeed interpreter."""

    preset: str = "medium"
    n_layer: int | None = None
    d_model: int | None = None
    n_head: int | None = None
    vocab_size: int | None = None
    seq_len: int = 128
    micro_batch: int = 1
    dtype: str = "fp32"
    #: elements per gradient bucket (zkit's and DeepSpeed's reduce/allgather bucket, DDP's
    #: bucket_cap_mb), the same for every contestant
    bucket_numel: int = 5_000_000
    warmup_steps: int = 1
    timed_steps: int = 3
    seed: int = 1234
    #: ``zero_optimization.stage3_max_reuse_distance`` for zkit and DeepSpeed alike (None: the
    #: default, 1e9 elements; the scale search releases every module after use: 0)
    stage3_max_reuse_distance: int | None = None

    def gpt_config(self) -> GPTConfig:
        overrides = {
            k: getattr(self, k)
            for k in ("n_layer", "d_model", "n_head", "vocab_size")
            if getattr(self, k) is not None
        }
        return GPTConfig.preset(self.preset, seq_len=self.seq_len, **overrides)

    def num_parameters(self) -> int:
        return self.gpt_config().num_parameters()

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Workload":
        return cls(**data)


def build_model(w: Workload) -> GPT:
    """The model in fp32 from the workload's seed (each engine casts it to its precision)."""
    torch.manual_seed(w.seed)
    return GPT(w.gpt_config())


def batches(w: Workload, rank: int, count: int) -> list[torch.Tensor]:
    """``count`` token batches for ``rank``: the same for every contestant. Used as inputs and,
    unshifted, as labels; the loss value is irrelevant here, only the work is."""
    g = torch.Generator().manual_seed(w.seed * 1009 + rank)
    vocab = w.gpt_config().vocab_size
    return [torch.randint(0, vocab, (w.micro_batch, w.seq_len), generator=g) for _ in range(count)]


def timed_steps(w: Workload, step: Callable[[torch.Tensor], Any]) -> list[float]:
    """Run ``warmup_steps`` then ``timed_steps`` steps; return the timed steps' seconds.

    Each step starts after a barrier, so every rank measures the same interval; the caller takes
    the slowest rank per step (the step is over when the last rank is done)."""
    data = batches(w, dist.get_rank(), w.warmup_steps + w.timed_steps)
    times = []
    for i, batch in enumerate(data):
        dist.barrier()
        start = time.perf_counter()
        step(batch)
        if i >= w.warmup_steps:
            times.append(time.perf_counter() - start)
    return times


def slowest_rank(per_rank: list[list[float]]) -> list[float]:
    """Per step, the slowest rank's time."""
    return [max(ts) for ts in zip(*per_rank)]


def median_and_spread(samples: list[float]) -> tuple[float, float]:
    """Median and relative half-range ``(max - min) / 2 / median`` of step times."""
    if not samples:
        return float("nan"), float("nan")
    med = statistics.median(samples)
    return med, (max(samples) - min(samples)) / 2 / med


def rss_bytes() -> int:
    """This process's resident set now (Linux)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class RssGuard:
    """Ends this process (exit code :data:`OVER_CAP_EXIT`) when its resident set exceeds
    ``limit_bytes``, checked every ``period_s`` from a thread. Torch ops release the GIL, so the
    check runs while a large allocation or kernel is under way; a rank over its share of the
    machine is stopped before the machine runs out of memory (the others then fail on their
    next collective)."""

    OVER_CAP_EXIT = 86

    def __init__(self, limit_bytes: int, period_s: float = 0.05) -> None:
        self.limit = int(limit_bytes)
        self.period = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rss-guard", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.period):
            if rss_bytes() > self.limit:
                os.write(2, f"rss guard: resident set over {self.limit} bytes, stopping\n".encode())
                os._exit(self.OVER_CAP_EXIT)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
