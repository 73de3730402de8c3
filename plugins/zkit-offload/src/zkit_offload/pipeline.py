"""The sub-group pipeline of NVMe offload: read sub-group i+1 while sub-group i steps and
sub-group i-1 is written back.

A *sub-group* is a set of named flat tensors that live on NVMe between steps (the optimizer state
of ``sub_group_size`` parameters, for example ``{"exp_avg": n, "exp_avg_sq": n}``). The pipeline
owns ``buffer_count`` host buffer sets, each big enough for the largest sub-group, and cycles them:

    read 0 | read 1, step 0 | read 2, step 1, write 0 | ... | step n-1, write n-2 | write n-1

With two buffers a read must wait for the write that last used its buffer (DeepSpeed's double
buffering); three or more let the read of i+1 and the write of i-1 overlap as well.
"""
from __future__ import annotations

from typing import Callable, Container, Mapping, Sequence

import torch

from zkit_offload.swap import NVMeSwapper, SwapHandle, aligned_empty


def subgroup_key(index: int, name: str) -> str:
    """The swap key of tensor ``name`` of sub-group ``index``."""
    return f"sg{index}.{name}"


class SubGroupBuffers:
    """``buffer_count`` sets of aligned host buffers, one flat tensor per name, sized for the
    largest sub-group. Reused by every step (allocate once, not per step)."""

    def __init__(self, subgroups: Sequence[Mapping[str, int]], buffer_count: int = 2,
                 dtype: torch.dtype = torch.float32) -> None:
        if buffer_count < 2:
            raise ValueError(f"the sub-group pipeline needs buffer_count >= 2, got {buffer_count}")
        names = sorted({name for sg in subgroups for name in sg})
        size = {name: max((sg.get(name, 0) for sg in subgroups), default=0) for name in names}
        self.dtype = dtype
        self.sets = [{name: aligned_empty(size[name], dtype) for name in names} for _ in range(buffer_count)]

    def views(self, slot: int, subgroup: Mapping[str, int]) -> dict[str, torch.Tensor]:
        return {name: self.sets[slot][name][:n] for name, n in subgroup.items()}


def step_in_subgroups(
    swapper: NVMeSwapper,
    subgroups: Sequence[Mapping[str, int]],
    step: Callable[[int, dict[str, torch.Tensor]], None],
    buffers: SubGroupBuffers,
    *,
    fresh: bool | Container[int] = False,
    fresh_names: Container[str] | None = None,
    read_only: Container[str] = (),
) -> None:
    """Run ``step(i, tensors)`` for every sub-group with its tensors read from NVMe, written back
    after the step, overlapping the I/O of neighbours with the step (see the module docstring).

    ``fresh=True`` skips the reads and hands ``step`` zero-filled buffers (the first step, when
    nothing was swapped out yet); a collection of indices does so for those sub-groups only;
    ``fresh_names`` limits this to some tensors (default: all). Tensors named in ``read_only``
    are not written back. A failed read or write raises :class:`~zkit_offload.SwapError`
    after the pending I/O has finished; a sub-group whose write failed is never read again.
    """
    n = len(subgroups)
    slots = len(buffers.sets)
    reads: list[SwapHandle | None] = [None] * n
    writes: list[SwapHandle | None] = [None] * n

    def start_read(i: int) -> None:
        if i - slots >= 0 and writes[i - slots] is not None:
            writes[i - slots].wait()  # its buffer is the one we are about to fill
        views = buffers.views(i % slots, subgroups[i])
        is_fresh = fresh is True or (fresh is not False and i in fresh)
        zeroed = [name for name in views if is_fresh and (fresh_names is None or name in fresh_names)]
        reads[i] = read_subgroup(swapper, i, views, zeroed)

    try:
        if n:
            start_read(0)
        for i in range(n):
            if i + 1 < n:
                start_read(i + 1)
            if reads[i] is not None:
                reads[i].wait()
            views = buffers.views(i % slots, subgroups[i])
            step(i, views)
            writes[i] = write_subgroup(swapper, i, views, skip=read_only)
    finally:  # finish every pending request before reporting the first error
        HandleGroup([h for h in (*reads, *writes) if h is not None]).wait()


def read_subgroup(swapper: NVMeSwapper, index: int, views: Mapping[str, torch.Tensor],
                  zeroed: Container[str] = ()) -> "HandleGroup":
    """Start reading sub-group ``index``'s tensors into ``views``; those named in ``zeroed`` are
    zero-filled instead (nothing of theirs is on the disk yet)."""
    handles = []
    for name, t in views.items():
        if name in zeroed:
            t.zero_()
        else:
            handles.append(swapper.swap_in(subgroup_key(index, name), t))
    return HandleGroup(handles)


def write_subgroup(swapper: NVMeSwapper, index: int, views: Mapping[str, torch.Tensor],
                   skip: Container[str] = ()) -> "HandleGroup":
    """Start writing sub-group ``index``'s tensors from ``views``, but those named in ``skip``."""
    return HandleGroup([swapper.swap_out(subgroup_key(index, name), t) for name, t in views.items()
                        if name not in skip])


class HandleGroup:
    """Several swap handles (or groups) waited on as one."""

    def __init__(self, handles: Sequence[SwapHandle | "HandleGroup"]) -> None:
        self.handles = handles

    def done(self) -> bool:
        """Whether every request has finished (without raising its error: :meth:`wait` does)."""
        return all(h.done() for h in self.handles)

    def wait(self) -> None:
        errors = []
        for h in self.handles:
            try:
                h.wait()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
