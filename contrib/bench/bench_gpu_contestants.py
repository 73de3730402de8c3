"""The contestants of ``bench_gpu.py``: how each one builds :class:`~bench_gpu_model.PlainGPT`
and takes a training step. Each runs alone in its own process (``bench_gpu.py`` starts one per
contestant), at world size 1, in a process group of its own.

* ``torch``: plain PyTorch, fp32 parameters, ``torch.autocast`` bf16, ``AdamW(fused=True)``;
* ``fsdp2``: ``fully_shard`` per block and at the root, bf16 parameters for compute
  (``MixedPrecisionPolicy``), the model built on ``meta`` and allocated sharded;
* ``zkit-0`` ... ``zkit-3``: zkit's ZeRO stages, bf16 parameters and gradients, fp32 master;
* ``zkit-2-offload``: stage 2, ``offload_optimizer`` on pinned host memory (ZeRO-Offload);
* ``zkit-3-offload``: stage 3, optimizer and parameters on pinned host memory, the model built
  under ``zkit.zero.Init``;
* ``zkit-3-nvme``: the same with both on NVMe (``--nvme-dir``);
* ``...-compile``: the contestant with its model under ``torch.compile`` (``engine.compile()``
  for zkit; stages 0-2).

With ``--dtype fp32`` (the CPU smoke run) nothing is cast: every contestant computes in fp32.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from bench_gpu_model import PlainGPT, Shape
from zero_workloads import ADAMW

BASE = ("torch", "fsdp2", "zkit-0", "zkit-1", "zkit-2", "zkit-3")
OFFLOADED = ("zkit-2-offload", "zkit-3-offload", "zkit-3-nvme")
#: stage 3 refuses torch.compile (zkit.core.compile)
COMPILED = ("torch-compile", "zkit-0-compile", "zkit-1-compile", "zkit-2-compile")
ALL = BASE + OFFLOADED + COMPILED
SUFFIX = "-compile"

#: a training step on a batch of token ids: ``step(ids) -> loss`` (detached)
Step = Callable[[torch.Tensor], torch.Tensor]


def zkit_config(name: str, micro_batch: int, dtype: str, nvme_dir: str | None,
                persistence: int | None = None) -> dict[str, Any]:
    """The DeepSpeed-style config of zkit contestant ``name``."""
    stage = int(name.split("-")[1])
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True}
    if persistence is not None:
        zero["stage3_param_persistence_threshold"] = persistence
    if name.endswith("-offload") or name.endswith("-nvme"):
        where = {"device": "cpu", "pin_memory": True}
        if name.endswith("-nvme"):
            where = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True}
        zero["offload_optimizer"] = dict(where)
        if stage == 3:
            zero["offload_param"] = dict(where)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
        "zero_optimization": zero,
        "steps_per_print": 1_000_000,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def build(name: str, shape: Shape, micro_batch: int, dtype: str, device: torch.device,
          nvme_dir: str | None, compile_backend: str, persistence: int | None = None) -> Step:
    """Contestant ``name``'s step on a freshly built model (seed 0)."""
    compiled = name.endswith(SUFFIX)
    base = name.removesuffix(SUFFIX)
    torch.manual_seed(0)
    if base == "torch":
        return _torch(shape, dtype, device, compile_backend if compiled else None)
    if base == "fsdp2":
        return _fsdp2(shape, dtype, device)
    cfg = zkit_config(base, micro_batch, dtype, nvme_dir, persistence)
    return _zkit(cfg, shape, compile_backend if compiled else None)


def _autocast(dtype: str, device: torch.device):
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _torch(shape: Shape, dtype: str, device: torch.device, backend: str | None) -> Step:
    model = PlainGPT(shape).to(device)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)
    forward = torch.compile(model, backend=backend) if backend else model
    return _optimizer_step(forward, opt, lambda: _autocast(dtype, device))


def _optimizer_step(forward: Callable[..., torch.Tensor], opt: torch.optim.Optimizer,
                    context: Callable[[], Any] = contextlib.nullcontext) -> Step:
    """A torch training step: the loss under ``context()``, backward, the optimizer's step."""

    def step(ids: torch.Tensor) -> torch.Tensor:
        with context():
            loss = forward(ids, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _fsdp2(shape: Shape, dtype: str, device: torch.device) -> Step:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = PlainGPT(shape)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # bench_host.py: 2 ranks too
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if dtype == "bf16" else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.reset_parameters()
    return _optimizer_step(model, torch.optim.AdamW(model.parameters(), **ADAMW, fused=True))


def _zkit(cfg: dict[str, Any], shape: Shape, backend: str | None) -> Step:
    import zkit

    with zkit.zero.Init(config=cfg, enabled=cfg["zero_optimization"]["stage"] == 3):
        model = PlainGPT(shape)
    engine, *_ = zkit.initialize(model=model, config=cfg)
    if backend:
        engine.compile(backend=backend)

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = engine(ids, ids)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    step.engine = engine  # type: ignore[attr-defined]  # closed by the caller
    return step
