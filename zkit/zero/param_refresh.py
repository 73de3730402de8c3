"""The parameter refresh of stages 1 and 2, optionally overlapped with the next forward.

After the optimizer step each rank holds updated values for its own shard of every unit; an
all-gather per unit brings everyone else's. Waiting for those all-gathers inside ``step()`` puts a
whole model's worth of communication on the critical path, which DDP does not pay. With
``zero_optimization.overlap_param_gather`` the gathers run in the background instead and the next
forward waits for each unit just before the first use of one of its parameters, so communication
hides behind compute (Megatron-LM's ``overlap_param_gather``).

"First use" is observed, not guessed: during the forward a :class:`~torch.overrides.TorchFunctionMode`
sees every torch call and waits for a parameter's unit when the parameter appears among the
arguments, whichever module's code reads it (a tied LM head reading the embedding's weight, a
parent reading a child's parameter). Units are gathered in forward order (the reverse of the
unit layout), so the first layers arrive first.

Everything else that reads parameters waits for all units first: a forward that bypasses the
engine (pre-hooks on the root module and every module holding parameters), ``state_dict()``, :func:`zkit.zero.GatheredParameters`,
checkpoint saving, and the next ``step()``. Code that reads ``module.parameters()`` directly
between ``engine.step()`` and the next forward must call :meth:`ParamRefresh.wait` (exposed as
``engine.wait_for_parameters()``) first; that is why the overlap is opt-in.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.overrides import TorchFunctionMode

from zkit.core.communicator import Handle

#: refreshes with gathers still in flight, so code that only has parameters can wait for them
_IN_FLIGHT: "weakref.WeakSet[ParamRefresh]" = weakref.WeakSet()


def without_effect(stage: int, world: int) -> str | None:
    """Why ``overlap_param_gather`` has nothing to overlap at ``stage`` over ``world`` replicas
    (said at initialize, not ignored), or ``None`` where it applies."""
    if stage == 0:
        return "ZeRO stage 0 keeps whole parameters on every rank: there is no parameter all-gather to overlap"
    if stage == 3:
        return "ZeRO stage 3 gathers each parameter inside forward (stage3_prefetch_bucket_size sets how far ahead)"
    if world == 1:
        return "one data-parallel replica holds every shard: there is no parameter all-gather to overlap"
    return None


def wait_for_parameter_refresh() -> None:
    """Wait for every background parameter all-gather of this process."""
    for refresh in list(_IN_FLIGHT):
        refresh.wait()


class ParamRefresh:
    """Background all-gathers of updated parameter units and the waits that guard their use.

    ``params_by_unit[u]`` are the parameters unit ``u`` holds.
    """

    def __init__(self, module: torch.nn.Module, params_by_unit: Sequence[Sequence[torch.Tensor]]) -> None:
        self.unit_of = {id(p): u for u, params in enumerate(params_by_unit) for p in params}
        #: unit -> handle of gathers not waited for yet, in launch order
        self.pending: dict[int, Handle] = {}
        self._in_engine_forward = False
        # Modules called outside the engine's forward (a pipeline stage's layers, a user calling a
        # submodule) wait for everything before they run.
        callers = [m for m in module.modules() if m is module or any(True for _ in m.parameters(recurse=False))]
        self._hooks = [m.register_forward_pre_hook(self._outside_forward) for m in callers]
        self._hooks.append(module.register_state_dict_pre_hook(lambda *args, **kwargs: self.wait()))

    def start(self, launch_all: Callable[[], dict[int, Handle]]) -> None:
        """Run ``launch_all()`` (unit -> handle of its all-gather, in launch order) and keep the
        handles to wait on; gathers still in flight from before are waited for first."""
        self.wait()
        self.pending = dict(launch_all())
        if self.pending:
            _IN_FLIGHT.add(self)

    def wait(self, unit: int | None = None) -> None:
        """Wait for ``unit`` (and the units launched before it), or for all of them."""
        while self.pending:
            first, handle = next(iter(self.pending.items()))
            handle.wait()
            del self.pending[first]
            if first == unit:
                break
        if not self.pending:
            _IN_FLIGHT.discard(self)

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Context of the engine's forward: wait per unit at first use, for the rest at the end."""
        self._in_engine_forward = True
        try:
            if self.pending:
                with _WaitOnFirstUse(self):
                    yield
            else:
                yield
        finally:
            self._in_engine_forward = False
            self.wait()

    def _outside_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not self._in_engine_forward:
            self.wait()

    def close(self) -> None:
        self.wait()
        for h in self._hooks:
            h.remove()
        self._hooks = []


class _WaitOnFirstUse(TorchFunctionMode):
    """Waits for a parameter's unit when a torch call receives the parameter."""

    def __init__(self, refresh: ParamRefresh) -> None:
        super().__init__()
        self.refresh = refresh

    def __torch_function__(self, func, types, args=(), kwargs=None):
        refresh = self.refresh
        if refresh.pending:
            for a in _tensor_args(args, kwargs):
                unit = refresh.unit_of.get(id(a))
                if unit is not None and unit in refresh.pending:
                    refresh.wait(unit)
        return func(*args, **(kwargs or {}))


def _tensor_args(args: tuple, kwargs: dict | None) -> Iterator[Any]:
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a
    if kwargs:
        yield from kwargs.values()
