"""Optimizer state that lives on NVMe between steps (ZeRO-Infinity's optimizer offload).

A fused CPU optimizer's parameters are packed, in order, into *sub-groups* of at most
``sub_group_size`` elements (a larger parameter is a sub-group on its own). Each sub-group has one
swap file per state tensor (``exp_avg``, ``exp_avg_sq``...) holding its parameters' states back to
back. :meth:`NVMeAllocator.step_optimizer <zkit_offload.NVMeAllocator.step_optimizer>` streams
the sub-groups through host buffers; in between, host memory keeps only the small per-parameter
entries (``step``).

:class:`SwappedState` replaces ``optimizer.state`` so that code reading the state the usual way
still sees all of it: ``state[p]``, ``state.get(p)`` and ``state.items()`` (checkpoint writers,
``optimizer.state_dict()``) read it back from the swap files, and ``state[p] = {...}`` (checkpoint
loading) keeps the given tensors in memory until the next step writes them to their sub-group.
``state.values()`` is the exception on purpose: it returns the host-resident entries only, so a
memory report does not read every state tensor back from the disk.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Iterator, Sequence

import torch

from zkit_offload.pipeline import subgroup_key
from zkit_offload.swap import NVMeSwapper


class SubGroupPlan:
    """Which parameters form each sub-group and where each one's state starts in it.

    Args:
        params: the optimizer's parameters in order (empty ones are left out: nothing to swap).
        state_names: the optimizer's per-element state tensors.
        sub_group_size: elements per sub-group (at least 1).
    """

    def __init__(self, params: Sequence[torch.Tensor], state_names: Sequence[str], sub_group_size: int) -> None:
        if sub_group_size < 1:
            raise ValueError(f"sub_group_size must be at least 1 element, got {sub_group_size}")
        self.params = [p for p in params if p.numel() > 0]
        self.state_names = tuple(state_names)
        #: per sub-group, ``[(param, offset in the sub-group)]``
        self.members: list[list[tuple[torch.Tensor, int]]] = []
        #: sub-group index of every parameter (by ``id``), and its offset in the sub-group
        self.where: dict[int, tuple[int, int]] = {}
        fill = sub_group_size  # forces a new sub-group for the first parameter
        for p in self.params:
            n = p.numel()
            if fill + n > sub_group_size and fill > 0:
                self.members.append([])
                fill = 0
            self.where[id(p)] = (len(self.members) - 1, fill)
            self.members[-1].append((p, fill))
            fill += n
        self.sizes = [sum(p.numel() for p, _ in m) for m in self.members]

    @classmethod
    def from_layout(cls, members: Sequence[Sequence[tuple[torch.Tensor, int]]], sizes: Sequence[int],
                    state_names: Sequence[str]) -> "SubGroupPlan":
        """A plan with a given layout: ``members[i]`` are ``(param, offset)`` pairs of sub-group
        ``i`` of ``sizes[i]`` elements (gaps allowed), as :mod:`zkit_offload.swapped_master` lays
        out whole units on aligned offsets."""
        self = cls.__new__(cls)
        self.state_names = tuple(state_names)
        self.members = [[(p, off) for p, off in m if p.numel() > 0] for m in members]
        self.params = [p for m in self.members for p, _ in m]
        self.where = {id(p): (i, off) for i, m in enumerate(self.members) for p, off in m}
        self.sizes = list(sizes)
        return self

    def __len__(self) -> int:
        return len(self.members)

    def subgroups(self) -> list[dict[str, int]]:
        """``[{state name: elements}]`` per sub-group, as the pipeline takes them."""
        return [{name: n for name in self.state_names} for n in self.sizes]

    def matches(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether ``params`` are this plan's parameters, in any order: the layout is found by
        ``id``, and a plan laid out by unit lists them in model order while an optimizer with
        several param groups (decay / no decay) lists them group by group."""
        ids = [id(p) for p in params if p.numel() > 0]
        return len(ids) == len(self.params) and set(ids) == set(self.where)


class SwappedState(defaultdict):
    """``optimizer.state`` whose per-element tensors are on NVMe between steps (module docstring).

    Args:
        plan: the sub-group layout of the swap files.
        swapper: where the sub-groups are written.
        resident: entries to start from (an optimizer's state before it was swapped, or loaded);
            their tensors are written to the swap files by the next step.
    """

    def __init__(self, plan: SubGroupPlan, swapper: NVMeSwapper, resident: dict | None = None) -> None:
        super().__init__(dict)
        self.plan = plan
        self.swapper = swapper
        #: sub-groups whose swap files hold their current state
        self.on_disk: set[int] = set()
        self._raw = False
        self._cache: tuple[int, dict[str, torch.Tensor]] | None = None
        for p, st in (resident or {}).items():
            dict.__setitem__(self, p, dict(st))

    # -- during a step: the stepping code sees the host-resident dicts ------------------------------
    @staticmethod
    def groups_by_param(optimizer: Any) -> dict[int, dict]:
        """``{id(param): its param group}``, for :meth:`bind` (once per step)."""
        return {id(p): g for g in optimizer.param_groups for p in g["params"]}

    @contextlib.contextmanager
    def raw(self) -> Iterator[None]:
        """Within this block ``state[p]`` is the host-resident dict itself (no reads)."""
        self._raw, self._cache = True, None
        try:
            yield
        finally:
            self._raw = False

    def resident(self, p: torch.Tensor) -> dict[str, Any]:
        """The host-resident entries of ``p`` (created empty)."""
        return super().__getitem__(p)

    def pending(self, p: torch.Tensor) -> bool:
        """Whether ``p`` holds state tensors in memory that its sub-group's file does not have yet."""
        st = dict.get(self, p)
        return bool(st) and all(torch.is_tensor(st.get(n)) and st[n].dim() > 0 for n in self.plan.state_names)

    def bind(self, index: int, tensors: dict[str, torch.Tensor], optimizer: Any, group_of: dict[int, dict]) -> None:
        """Point the state of sub-group ``index``'s parameters at ``tensors`` (its host buffers,
        read from the swap files), filling them first from state loaded since the last step or
        from the optimizer's initial state for parameters never stepped (``group_of``: each
        parameter's group by ``id``). Inside :meth:`raw`."""
        for p, offset in self.plan.members[index]:
            st = self.resident(p)
            views = {name: t[offset : offset + p.numel()].view(p.shape) for name, t in tensors.items()
                     if name in self.plan.state_names}
            if self.pending(p):  # loaded from a checkpoint since the last step
                for name, v in views.items():
                    v.copy_(st[name].reshape(p.shape))
            elif "step" not in st:  # never stepped: the optimizer's initial state
                optimizer._init_state(group_of[id(p)], p, st)
                for name, v in views.items():
                    v.copy_(st[name].reshape(p.shape))
            st.update(views)

    def unbind(self, index: int) -> None:
        """Drop the views :meth:`bind` made (the buffers go on to other sub-groups)."""
        for p, _ in self.plan.members[index]:
            st = self.resident(p)
            for name in self.plan.state_names:
                st.pop(name, None)

    # -- reading the whole state -----------------------------------------------------------------------
    def __getitem__(self, p: torch.Tensor) -> dict[str, Any]:
        if self._raw:
            return super().__getitem__(p)
        return self._materialise(p)

    def get(self, p: torch.Tensor, default: Any = None) -> Any:
        return self[p] if p in self else default

    def items(self) -> list[tuple[torch.Tensor, dict[str, Any]]]:  # type: ignore[override]
        return [(p, self[p]) for p in list(self.keys())]

    def __setitem__(self, p: torch.Tensor, value: dict[str, Any]) -> None:
        if not self._raw:
            self._cache = None
        super().__setitem__(p, value if isinstance(value, dict) else dict(value))

    def _materialise(self, p: torch.Tensor) -> dict[str, Any]:
        st = super().__getitem__(p)
        where = self.plan.where.get(id(p))
        if where is None or self.pending(p) or where[0] not in self.on_disk or "step" not in st:
            return st
        index, offset = where
        tensors = self._read(index)
        out = dict(st)
        for name, t in tensors.items():
            out[name] = t[offset : offset + p.numel()].view_as(p).clone()
        return out

    def _read(self, index: int) -> dict[str, torch.Tensor]:
        # One sub-group cached: a checkpoint reads its parameters one after the other.
        if self._cache is None or self._cache[0] != index:
            n = self.plan.sizes[index]
            tensors = {name: torch.empty(n, dtype=torch.float32, device="cpu") for name in self.plan.state_names}
            for name, t in tensors.items():
                self.swapper.read(subgroup_key(index, name), t)
            self._cache = (index, tensors)
        return self._cache[1]
