"""A trained parameter's full fp32 master and optimizer state, read or written by the parameter
alone, at any stage (DeepSpeed's ``safe_get_full_fp32_param`` and friends).

Each rank owns element ranges of the flattened parameter (:meth:`Partitioner.pieces`); a full
value is the owned ranges filled into zeros and summed over the data-parallel ranks. Every rank
of the group must call these together (they are collectives), as in DeepSpeed at stage 3.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from zkit.core.partitioner import Partitioner, Piece

#: id(trained parameter) -> (the parameter, its partitioner), both weakly: the engine owns them
#: (tensors compare elementwise, so they cannot be dictionary keys themselves)
_OWNER: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def register(partitioner: "Partitioner") -> None:
    """Make ``partitioner``'s trainable parameters answer the functions below."""
    for key in [k for k, (p, part) in _OWNER.items() if p() is None or part() is None]:
        del _OWNER[key]
    ref = weakref.ref(partitioner)
    for _, p in partitioner.named_trainable():
        _OWNER[id(p)] = (weakref.ref(p), ref)


def _owner(param: torch.Tensor) -> "Partitioner":
    p_ref, part_ref = _OWNER.get(id(param), (None, None))
    part = part_ref() if p_ref is not None and p_ref() is param else None
    if part is None:
        raise ValueError("this parameter is not trained by a live zkit engine (pass a parameter of the model given "
                         "to zkit.initialize, with requires_grad=True)")
    return part


def _pieces(part: "Partitioner", param: torch.Tensor) -> tuple[str, list["Piece"]]:
    name = next(n for n, p in part.named_trainable() if p is param)
    return name, [pc for pc in part.pieces() if pc.name == name]


def _full(part: "Partitioner", param: torch.Tensor, read) -> torch.Tensor | None:
    name, pieces = _pieces(part, param)
    shape = pieces[0].shape if pieces else tuple(getattr(param, "ds_shape", param.shape))
    numel = int(torch.Size(shape).numel())
    out = torch.zeros(numel, dtype=torch.float32, device=part.ctx.device)  # where the collectives run
    found = False
    for pc in pieces:
        values = read(pc)
        if values is None:
            continue
        found = True
        out[pc.start:pc.end].copy_(values.reshape(-1).to(out.device))
    if part.shards_states and part.comm.world_size > 1:
        flag = torch.tensor([1.0 if found else 0.0], device=out.device)
        part.comm.all_reduce(flag, "sum")
        part.comm.all_reduce(out, "sum")
        found = flag.item() > 0
    return out.view(shape) if found else None


def get_full_fp32_param(param: torch.Tensor) -> torch.Tensor:
    """The parameter's fp32 master, whole, on every rank."""
    part = _owner(param)
    out = _full(part, param, lambda pc: pc.master)
    assert out is not None
    return out


def get_full_optimizer_state(param: torch.Tensor, key: str) -> torch.Tensor | None:
    """The optimizer's ``key`` state (``"exp_avg"``, ``"exp_avg_sq"``, ...) of the parameter,
    whole, on every rank; ``None`` before the optimizer has made it."""
    part = _owner(param)

    def read(pc: "Piece") -> torch.Tensor | None:
        value = part.optimizer.state.get(pc.opt_param, {}).get(key)
        return value if torch.is_tensor(value) and value.numel() == pc.end - pc.start else None

    return _full(part, param, read)


def set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace the parameter's fp32 master (and so the parameter) with ``value`` (its full
    shape), on every rank together."""
    part = _owner(param)
    name, pieces = _pieces(part, param)
    flat = value.detach().reshape(-1).float()
    for pc in pieces:
        pc.master.view(-1).copy_(flat[pc.start:pc.end].to(pc.master.device))
    part.after_load(pieces)  # stores these copies (an offload store) and publishes the parameters


def set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, key: str) -> None:
    """Replace the optimizer's ``key`` state of the parameter with ``value`` (its full shape)."""
    part = _owner(param)
    _, pieces = _pieces(part, param)
    flat = value.detach().reshape(-1)
    for pc in pieces:
        state = part.optimizer.state[pc.opt_param]
        if key not in state:
            raise KeyError(f"the optimizer has no {key!r} state for this parameter yet (it has "
                           f"{', '.join(sorted(state)) or 'none'})")
        state[key].view(-1).copy_(flat[pc.start:pc.end].to(state[key].device))


def _grad_views(part: "Partitioner") -> dict[tuple[str, int, int], torch.Tensor]:
    return {(g.name, g.start, g.end): g.grad for g in part.reduced_grads()}


def get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The parameter's reduced gradient, whole, in fp32, on every rank (every rank calls it
    together), between the last backward of a batch and ``step``; None where there is none. As
    DeepSpeed's ``safe_get_full_grad``: averaged over the data-parallel ranks, and still
    multiplied by the loss scale under fp16."""
    part = _owner(param)
    views = _grad_views(part)
    return _full(part, param, lambda pc: views.get((pc.name, pc.start, pc.end)))


def set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace the parameter's reduced gradient with ``value`` (its full shape) before ``step``."""
    part = _owner(param)
    _, pieces = _pieces(part, param)
    views = _grad_views(part)
    flat = value.detach().reshape(-1)
    for pc in pieces:
        view = views.get((pc.name, pc.start, pc.end))
        if view is not None:
            view.view(-1).copy_(flat[pc.start:pc.end].to(view.device, view.dtype))
