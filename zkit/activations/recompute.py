"""Activation checkpointing: recompute a region's activations in backward instead of keeping them.

    import zkit.activations.recompute as ckpt
    ckpt.configure(engine)                     # the config's "activation_checkpointing" section
    y = ckpt.checkpoint(block, x)              # one region
    ckpt.apply(model, "every_k:2")             # or wrap blocks by policy; ckpt.remove(model) undoes

Non-reentrant by default (``torch.utils.checkpoint`` with ``use_reentrant=False``): a parameter
used in several regions gets its gradient accumulated once, by the single backward pass, so
ZeRO's gradient hooks fire once per parameter. The RNG state is restored for recomputation, so
dropout draws the same masks (the default generators, and zkit-pipeline's tensor-parallel
stream, see :mod:`zkit.activations.replayed_rng`). What the DeepSpeed keys do is in ``docs/memory.md``.
Under ``torch.compile`` a region compiles into the surrounding graph unless an option needs
bookkeeping around it (:mod:`zkit.activations.tracing`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

import attrs
import torch
import torch.utils.checkpoint as torch_checkpoint

from zkit.activations.policy import CheckpointWrapper, Policy, remove, select_blocks, wrap
from zkit.activations.replayed_rng import TrackerStates, register_rng_tracker
from zkit.activations.settings import CheckpointSettings, as_communicator, assembly_of, section_from
from zkit.activations.storage import InputStore
from zkit.activations.tracing import eager_reasons
from zkit.core.config import read_config_file

log = logging.getLogger("zkit.activations.recompute")

__all__ = [
    "CheckpointSettings",
    "CheckpointWrapper",
    "apply",
    "checkpoint",
    "configure",
    "is_configured",
    "profile_report",
    "register_rng_tracker",
    "remove",
    "reset",
    "select_blocks",
    "settings",
]


class _State:
    settings = CheckpointSettings()
    store = InputStore(settings)
    configured = False
    #: region name -> [calls, forward seconds, recomputations, recompute seconds]
    profile: dict[str, list[float]] = {}
    group_stores: dict[int, InputStore] = {}
    warned: set[tuple[str, ...]] = set()  # the reasons already logged for running regions eagerly


@runtime_checkable
class ModelParallelUnit(Protocol):
    """Megatron's ``mpu`` as DeepSpeed scripts pass it: the tensor-parallel group's provider."""

    def get_model_parallel_group(self) -> Any: ...


def configure(
    config_or_engine: Any = None,
    *,
    mpu_: ModelParallelUnit | None = None,
    deepspeed_config: Any = None,
    group: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
    pin_memory: bool | None = None,
) -> CheckpointSettings:
    """Set how :func:`checkpoint` behaves in this process (like ``deepspeed.checkpointing.configure``).

    ``config_or_engine``: an engine (its config section and its allocator, which then counts and
    places host copies), a :class:`~zkit.core.config.ZkitConfig`, a config dict, or ``None`` for the
    defaults. ``group``: the tensor-parallel communicator (or torch ProcessGroup) that
    ``partition_activations`` splits saved inputs over; without one that key does nothing. The
    keywords override the config, with DeepSpeed's argument names.

    DeepSpeed's own call also works unchanged: ``configure(mpu, deepspeed_config=path_or_dict)``
    (``mpu_`` by keyword, or as the first argument): the tensor-parallel group is
    ``mpu.get_model_parallel_group()`` and the section is read from ``deepspeed_config``."""
    if isinstance(config_or_engine, ModelParallelUnit):  # DeepSpeed's positional mpu_
        if mpu_ is not None:
            raise ValueError("configure: an mpu was given both as the first argument and as mpu_=")
        config_or_engine, mpu_ = None, config_or_engine
    if deepspeed_config is not None:
        if config_or_engine is not None:
            raise ValueError("configure: give the config either as the first argument or as deepspeed_config=, not both")
        config_or_engine = deepspeed_config
    if isinstance(config_or_engine, (str, os.PathLike)):
        config_or_engine = read_config_file(Path(config_or_engine))
    if mpu_ is not None:
        if group is not None:
            raise ValueError("configure: give the tensor-parallel group either as group= or through mpu_, not both")
        group = mpu_.get_model_parallel_group()
    section, allocator = section_from(config_or_engine)
    overrides = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    for key, value in overrides.items():
        if value is None:
            continue
        if key == "number_checkpoints":
            if type(value) is not int or value < 1:
                raise ValueError(f"num_checkpoints must be an int >= 1, got {value!r}")
        elif type(value) is not bool:
            raise ValueError(f"{key} must be a bool, got {value!r}")
    assembly = assembly_of(config_or_engine)
    extra = {"group": as_communicator(group, assembly), "allocator": allocator, "assembly": assembly}
    if pin_memory is not None:
        extra["pin_memory"] = bool(pin_memory)
    settings = CheckpointSettings.from_section(section, **extra)
    settings = attrs.evolve(settings, **{k: v for k, v in overrides.items() if v is not None})
    if settings.contiguous_memory_optimization and not (settings.partition_activations or settings.cpu_checkpointing):
        raise ValueError(
            "activation_checkpointing.contiguous_memory_optimization arranges the copies that "
            "partition_activations or cpu_checkpointing make; turn one of them on as well"
        )
    if settings.partition_activations and not settings.splits:
        log.info(
            "activation_checkpointing.partition_activations: no tensor-parallel group of more than "
            "one rank was given (configure(..., group=...)), so saved inputs are not split"
        )
    _State.settings, _State.store, _State.configured = settings, InputStore(settings), True
    _State.group_stores = {}
    return settings


def is_configured() -> bool:
    """Whether :func:`configure` has been called (since the last :func:`reset`)."""
    return _State.configured


def settings() -> CheckpointSettings:
    """The settings :func:`checkpoint` uses now."""
    return _State.settings


def reset() -> None:
    """Back to the defaults: forget the configuration, the arenas and the profile."""
    _State.settings = CheckpointSettings()
    _State.store = InputStore(_State.settings)
    _State.configured = False
    _State.profile = {}
    _State.group_stores = {}
    _State.warned = set()


def profile_report() -> dict[str, dict[str, float]]:
    """Per region: ``calls``, ``forward_s``, ``recomputes``, ``recompute_s`` (with ``profile`` on)."""
    return {
        name: {"calls": int(c), "forward_s": f, "recomputes": int(r), "recompute_s": rs}
        for name, (c, f, r, rs) in _State.profile.items()
    }


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool = False,
    preserve_rng_state: bool = True,
    group: Any = None,
    name: str | None = None,
    **kwargs: Any,
) -> Any:
    """``function(*args, **kwargs)``, its activations recomputed in backward instead of kept.

    ``use_reentrant``, ``preserve_rng_state``: as in ``torch.utils.checkpoint`` (non-reentrant
    supports keyword arguments, nesting and ``torch.autograd.grad``). ``group`` overrides the
    configured tensor-parallel group for this call. ``name`` labels the region in the profile.
    Other keyword arguments go to ``function``."""
    return checkpoint_call(
        function, args, kwargs, use_reentrant=use_reentrant, preserve_rng_state=preserve_rng_state,
        group=group, name=name,
    )


def _store_for(group: Any) -> InputStore:
    if group is None:
        return _State.store
    store = _State.group_stores.get(id(group))
    if store is None:
        s = attrs.evolve(_State.settings, group=as_communicator(group, _State.settings.assembly))
        store = _State.group_stores[id(group)] = InputStore(s)
        store.group_ref = group  # keeps id(group) from being reused while cached
    return store


def _sync(settings: CheckpointSettings) -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def apply(model: torch.nn.Module, policy: Policy = "every", **options: Any) -> list[str]:
    """Checkpoint the blocks ``policy`` selects (:mod:`zkit.activations.policy`); returns their
    qualified names. ``options`` are passed to every :func:`checkpoint` call (``use_reentrant``,
    ``preserve_rng_state``, ``group``). Raises if the policy selects nothing or a selected block is
    already checkpointed; :func:`remove` undoes it."""
    return wrap(model, policy, checkpoint_call, **options)


def checkpoint_call(
    function: Callable[..., Any],
    args: tuple,
    kwargs: dict[str, Any],
    *,
    use_reentrant: bool = False,
    preserve_rng_state: bool = True,
    group: Any = None,
    name: str | None = None,
) -> Any:
    """:func:`checkpoint` with the function's arguments passed as a tuple and a dict."""
    # Dynamo cannot trace callable() on a wrapped forward (compiled, a non-callable fails when called)
    if not torch.compiler.is_compiling() and not callable(function):
        raise TypeError(f"checkpoint needs a callable, got {type(function).__name__}")
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)  # nothing is saved for backward: nothing to recompute
    if use_reentrant and kwargs:
        raise ValueError(
            f"the reentrant checkpoint takes positional arguments only, got keyword(s) {', '.join(kwargs)}; "
            "use the default use_reentrant=False"
        )
    eager = eager_reasons(_State.settings, group, preserve_rng_state)
    if not eager:
        # nothing to time, store or replay: torch's checkpoint alone, which Dynamo traces into
        # the surrounding graph (zkit.activations.tracing)
        return torch_checkpoint.checkpoint(
            function, *args, use_reentrant=use_reentrant, preserve_rng_state=preserve_rng_state, **kwargs
        )
    under_compile = tuple(eager) if torch.compiler.is_compiling() else ()
    return _checkpoint_with_bookkeeping(
        function, args, kwargs, use_reentrant, preserve_rng_state, group, name, under_compile
    )


def _warn_eager_under_compile(reasons: tuple[str, ...]) -> None:
    if reasons and reasons not in _State.warned:
        _State.warned.add(reasons)
        log.warning(
            "torch.compile: checkpointed regions run eagerly, each at a graph break, because of %s; "
            "without these the regions compile into the surrounding graph", " and ".join(reasons),
        )


# Under torch.compile the region runs eagerly at a graph break of its own (torch's checkpoint, called
# outside a trace, runs its function eagerly anyway); traced, the counters would become guards.
@torch.compiler.disable
def _checkpoint_with_bookkeeping(
    function: Callable[..., Any], args: tuple, kwargs: dict[str, Any], use_reentrant: bool,
    preserve_rng_state: bool, group: Any, name: str | None, under_compile: tuple[str, ...] = (),
) -> Any:
    _warn_eager_under_compile(under_compile)
    store = _store_for(group)
    s = store.settings
    label = name or getattr(function, "__qualname__", type(function).__name__)
    replay = TrackerStates() if preserve_rng_state else None
    calls = 0

    def run(*a: Any, **k: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return function(*a, **k)
        if s.synchronize_checkpoint_boundary:
            _sync(s)
        started = time.perf_counter()
        try:
            with replay.replayed() if replay is not None else contextlib.nullcontext():
                return function(*a, **k)
        finally:
            # Recomputation may stop early (by exception) once the tensors backward needs exist.
            if s.profile:
                _sync(s)
                seconds = time.perf_counter() - started
                _record(label, recompute=seconds)
                log.info("checkpoint %s: recompute %.3f ms", label, seconds * 1e3)

    if s.synchronize_checkpoint_boundary:
        _sync(s)
    started = time.perf_counter()
    with store.hooks() if s.transforms_inputs else contextlib.nullcontext():
        out = torch_checkpoint.checkpoint(
            run, *args, use_reentrant=use_reentrant, preserve_rng_state=preserve_rng_state, **kwargs
        )
    if s.synchronize_checkpoint_boundary or s.profile:
        _sync(s)
    if s.profile:
        seconds = time.perf_counter() - started
        _record(label, forward=seconds)
        log.info("checkpoint %s: forward %.3f ms", label, seconds * 1e3)
    return out


def _record(label: str, forward: float | None = None, recompute: float | None = None) -> None:
    entry = _State.profile.setdefault(label, [0, 0.0, 0, 0.0])
    if forward is not None:
        entry[0] += 1
        entry[1] += forward
    if recompute is not None:
        entry[2] += 1
        entry[3] += recompute
