"""The contestants that run in zkit's interpreter: zkit's ZeRO stages, torch DDP, torch
``ZeroRedundancyOptimizer`` and torch FSDP2 (``fully_shard``), plus zkit's memory and traffic
measurement. Every function named ``*_ranks`` runs on each rank of a gloo group
(:func:`zkit.testing.run_ranks`) and returns plain values.

Precision: with ``bf16`` zkit keeps bf16 parameters and gradients and an fp32 master shard. The torch
contestants use torch's own mixed-precision recipe: DDP and ZeroRedundancyOptimizer keep fp32
parameters and run forward/backward under ``torch.autocast("cpu", torch.bfloat16)``; FSDP2 casts
parameters to bf16 for compute and reduces gradients in bf16 (``MixedPrecisionPolicy``).
"""
from __future__ import annotations

import contextlib
import gc
import os
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from zero_workloads import ADAMW, Workload, build_model, timed_steps

ZKIT_STAGES = (0, 1, 2, 3)
TORCH_CONTESTANTS = ("torch DDP", "torch ZeRO-opt", "torch FSDP2")

# (step function, close function)
Built = tuple[Callable[[torch.Tensor], Any], Callable[[], None]]


def zkit_config(w: Workload, stage: int) -> dict[str, Any]:
    """The DeepSpeed-style config both zkit and DeepSpeed get (same keys, same values)."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": w.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": w.bucket_numel,
            "allgather_bucket_size": w.bucket_numel,
            "overlap_comm": True,  # reduce during backward, as DDP does
        },
        "steps_per_print": 1_000_000,
        "seed": w.seed,
    }
    if w.stage3_max_reuse_distance is not None:
        cfg["zero_optimization"]["stage3_max_reuse_distance"] = w.stage3_max_reuse_distance
    if w.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif w.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


#: suffix of the zkit contestants that run with ``overlap_param_gather`` (a zkit-only key)
OVERLAP_GATHER = "+gather"
#: suffix of the stage-3 contestant that releases every module after use
#: (``stage3_max_reuse_distance: 0``: the paper's 3Ψ traffic, the least memory)
RELEASE = " reuse=0"


def zkit_engine_config(w: Workload, name: str) -> dict[str, Any]:
    """The config of zkit contestant ``name``: :func:`zkit_config` plus its variant's keys."""
    cfg = zkit_config(w, zkit_stage(name))
    cfg["zero_optimization"]["overlap_param_gather"] = name.endswith(OVERLAP_GATHER)
    if name.endswith(RELEASE):
        cfg["zero_optimization"]["stage3_max_reuse_distance"] = 0
    return cfg


def build_zkit(w: Workload, name: str, stack: Any = None) -> Any:
    """zkit's engine; at stage 3 the model is built under ``zkit.zero.Init``, so no rank ever
    holds more than its shard of the fp32 weights (as a ZeRO-3 user builds a large model).
    ``stack``: a ``zkit.Stack`` on top of the config (the phase breakdown's timed communicator)."""
    import zkit

    cfg = zkit_engine_config(w, name)
    with zkit.zero.Init(config=cfg, enabled=zkit_stage(name) == 3):
        model = build_model(w)
    engine, *_ = zkit.initialize(model=model, config=cfg, stack=stack)
    return engine


def zkit_stage(name: str) -> int:
    """``"zkit ZeRO-2+gather"`` -> 2."""
    return int(name.removeprefix("zkit ZeRO-")[0])


def _zkit(w: Workload, name: str) -> Built:
    engine = build_zkit(w, name)

    def step(batch: torch.Tensor) -> None:
        loss = engine(batch, batch)
        engine.backward(loss)
        engine.step()

    return step, engine.close


def _autocast(w: Workload):
    if w.dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=w.torch_dtype)


def _ddp_model(w: Workload) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    bucket_mb = w.bucket_numel * 4 / 2**20  # gradients are fp32 under autocast
    return DistributedDataParallel(build_model(w), bucket_cap_mb=bucket_mb)


def _ddp(w: Workload) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _ddp_model(w)
    return model, torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)


def _zero_redundancy(w: Workload) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = _ddp_model(w)
    return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW, fused=True)


def _fsdp2(w: Workload) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):  # FSDP2's way to build a model larger than one rank: shard, then allocate
        model = build_model(w)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy()
    if w.dtype != "fp32":
        mp = MixedPrecisionPolicy(param_dtype=w.torch_dtype, reduce_dtype=w.torch_dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device="cpu")
    torch.manual_seed(w.seed)
    model.reset_parameters()
    return model, torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)


def build_torch_parts(w: Workload, name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Model and optimizer of torch contestant ``name``."""
    return {"torch DDP": _ddp, "torch ZeRO-opt": _zero_redundancy, "torch FSDP2": _fsdp2}[name](w)


def torch_forward(w: Workload, model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The loss; DDP and ZeroRedundancyOptimizer keep fp32 parameters and compute under autocast,
    FSDP2 casts the parameters itself."""
    from torch.distributed.fsdp import FSDPModule

    with contextlib.nullcontext() if isinstance(model, FSDPModule) else _autocast(w):
        return model(batch, batch)


def build_contestant(w: Workload, name: str) -> Built:
    if name.startswith("zkit ZeRO-"):
        return _zkit(w, name)
    model, opt = build_torch_parts(w, name)

    def step(batch: torch.Tensor) -> None:
        torch_forward(w, model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, lambda: None


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:160]


def speed_round_ranks(w: Workload, names: list[str]) -> dict[str, Any]:
    """One round: each contestant in turn is built, warmed up, timed and torn down (one at a
    time, so memory holds one model). Returns ``{name: [seconds...]}`` or ``{name: "error"}``."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in names:
        step = close = None
        try:
            step, close = build_contestant(w, name)
            try:
                out[name] = timed_steps(w, step)
            finally:
                close()
        except Exception as exc:  # noqa: BLE001 - a failing contestant is a table entry, not a crash
            if dist.get_rank() == 0:
                traceback.print_exc()
            out[name] = _first_line(exc)
            dist.barrier()  # the other ranks may have failed elsewhere; meet before going on
        del step, close
        gc.collect()
    return out


STATE_PURPOSES = ("param", "grad", "master", "master_grad", "optim_state")


def state_ranks(w: Workload, stages: list[int]) -> dict[int, Any]:
    """Per zkit stage: model-state bytes by purpose (after a step, so the optimizer state exists),
    bucket scratch, and the communicator's bytes for one further step."""
    torch.set_num_threads(1)
    out: dict[int, Any] = {}
    for stage in stages:
        engine = None
        try:
            # stage 3 as the paper counts it: every module released after use (3Ψ of traffic)
            engine = build_zkit(w, f"zkit ZeRO-{stage}" + (RELEASE if stage == 3 else ""))
            data = [torch.randint(0, w.gpt_config().vocab_size, (w.micro_batch, w.seq_len)) for _ in range(2)]
            for i, batch in enumerate(data):
                if i == 1:
                    engine.comm.reset_stats()
                loss = engine(batch, batch)
                engine.backward(loss)
                engine.step()
            mem = engine.memory()
            out[stage] = {
                "state": {p: mem.get(f"{p}_bytes", 0) for p in STATE_PURPOSES},
                "bucket_peak": mem.get("bucket_peak_bytes", 0),
                "comm": engine.comm_stats(),
            }
        except Exception as exc:  # noqa: BLE001
            if dist.get_rank() == 0:
                traceback.print_exc()
            out[stage] = _first_line(exc)
            dist.barrier()
        finally:
            if engine is not None:
                engine.close()
            del engine
            gc.collect()
    return out


def train_ranks(w: Workload, name: str, rss_cap: int, cgroup_procs: str | None = None) -> dict[str, Any]:
    """Build ``name`` and train ``w.timed_steps`` steps under a per-rank resident-set cap (scale
    mode); returns the step times and this rank's peak resident set. ``cgroup_procs``: the job's
    memory cgroup (its ``cgroup.procs``), which the rank joins first, as a rank of a job under a
    container's or a scheduler's memory limit runs (the limit a library may read)."""
    from zero_workloads import RssGuard, peak_rss_bytes

    if cgroup_procs is not None:
        with open(cgroup_procs, "w") as f:
            f.write(str(os.getpid()))
    torch.set_num_threads(1)
    guard = RssGuard(rss_cap)
    try:
        step, close = build_contestant(w, name)
        times = timed_steps(w, step)
        close()
        return {"times": times, "peak_rss": peak_rss_bytes()}
    finally:
        guard.stop()
