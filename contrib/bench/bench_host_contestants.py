"""The torch-side contestants of ``bench_host.py``, built on the ranks of the current process
group: plain PyTorch (DDP over more than one rank), FSDP2 and zkit's stages and offloads, as
``bench_gpu_contestants.py`` builds them for one GPU. Each comes with the predicate saying which
of its tensors would live in host memory on an accelerator (an offloaded optimizer's)."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from bench_gpu_contestants import _autocast, _fsdp2, _optimizer_step, _zkit, zkit_config
from bench_gpu_model import PlainGPT, Shape
from zero_workloads import ADAMW


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors an optimizer holds: its parameters, their gradients, its state."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
            out += [v for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v)]
    return out


def build_torch_side(name: str, shape: Shape, micro_batch: int, dtype: str
                     ) -> tuple[Callable[[torch.Tensor], Any], Callable[[torch.Tensor], bool] | None, Callable[[], None]]:
    """``(step, host_resident, close)`` of contestant ``name`` (seed 0)."""
    from zkit.step_counts import storages_of

    device = torch.device("cpu")
    torch.manual_seed(0)
    if name == "torch":
        model = PlainGPT(shape)
        opt = torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)
        forward = model
        if dist.get_world_size() > 1:
            forward = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        return _optimizer_step(forward, opt, lambda: _autocast(dtype, device)), None, lambda: None
    if name == "fsdp2":
        return _fsdp2(shape, dtype, device), None, lambda: None
    step = _zkit(zkit_config(name, micro_batch, dtype, None), shape, None)
    engine = step.engine  # type: ignore[attr-defined]
    resident = None
    if name.endswith("-offload"):
        part = engine.partitioner
        flag = lambda: [part.master_store.host_flag] if part.master_store.host_flag is not None else []  # noqa: E731
        resident = storages_of(lambda: optimizer_tensors(part.optimizer) + list(part.grad_shards) + flag())
    return step, resident, engine.close
