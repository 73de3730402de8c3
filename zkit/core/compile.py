"""``torch.compile`` under the engine: ``engine.compile()`` and compiled modules given to ``initialize``.

Two ways in, as DeepSpeed and FSDP2 users write them:

* ``engine.compile(backend="inductor", compile_kwargs={})`` after ``initialize`` (DeepSpeed's
  call): the wrapped module is compiled in place (``nn.Module.compile``);
* ``zkit.initialize(model=torch.compile(model), ...)``: the ``OptimizedModule`` is unwrapped, the
  engine trains the original module (so parameter names, checkpoints and ``engine.module`` stay the
  model's own, without ``_orig_mod.``) and compiles it in place with the wrapper's own compiler
  context, i.e. the same backend and options.

Either way only the module's forward is compiled; the engine's own steps (hooks, reductions, the
optimizer step) stay eager. A partitioner that names regions
(:meth:`~zkit.core.partitioner.Partitioner.compile_regions`) has ``engine.compile`` compile each
region's forward instead (regional compilation), the module hooks around each region left eager:
zkit.zero's stage 3 gathers a block before its compiled forward and releases it after, outside the
compiled code (compiled whole, its released parameters, placeholders that become their gathered
values inside the forward, made Dynamo, which guards each compiled forward on the parameters'
shapes and strides as it found them, compile the forward again at every step). Otherwise a
partitioner whose record gives a ``compile_refusal`` is refused with that reason
(:func:`refuse_partitioner`), as stage 3 is for a model handed to ``initialize`` compiled.

The engine's FLOP probe measures the first training micro-step under ``FlopCounterMode``, a
dispatch mode Dynamo refuses to trace; a frame Dynamo refused once is never compiled again. So the
probed micro-step runs the module eagerly (:func:`eager`), and compilation starts with the next.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Iterator

import torch

from zkit.core.records import PartitionerRecord

log = logging.getLogger("zkit")

#: what DeepSpeed's ``engine.compile`` accepts that zkit does not do, and why
_DEEPCOMPILE = ("engine.compile(schedule=...) configures DeepSpeed's DeepCompile passes, which zkit does not have; "
                "call engine.compile() without schedule= to compile the module's forward with torch.compile")
_COMPILED_AUTOGRAD = ("engine.compile(compiled_autograd_enabled=True) is not supported: ZeRO's gradient hooks "
                      "reduce and release buffers from inside backward, which compiled autograd would trace; "
                      "compile the forward only (compiled_autograd_enabled=False)")


def refuse_partitioner(partitioner: PartitionerRecord) -> None:
    """Raise where the ``partitioner`` record says it cannot train a compiled module."""
    if partitioner.compile_refusal:
        where = f"partitioner {partitioner.name!r} of {partitioner.dist or 'zkit'}"
        raise ValueError(f"{partitioner.compile_refusal} ({where})")


def unwrap_compiled(model: torch.nn.Module) -> tuple[torch.nn.Module, Any]:
    """``(module, dynamo context)`` of a ``torch.compile``-d module; ``(model, None)`` for any other."""
    # Dynamo is not imported for a model that was never compiled (importing it takes a second)
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None or not isinstance(model, eval_frame.OptimizedModule):
        return model, None
    context = getattr(model, "dynamo_ctx", None)
    if context is None:  # a torch whose wrapper no longer keeps its compiler context
        raise TypeError(
            f"initialize(model=torch.compile(...)): this torch {torch.__version__} does not say how the module was "
            f"compiled; pass the module itself and call engine.compile(backend=..., compile_kwargs=...)"
        )
    return model._orig_mod, context


def compile_in_place(module: torch.nn.Module, partitioner: PartitionerRecord, context: Any) -> None:
    """Compile ``module``'s calls with the compiler context taken from an ``OptimizedModule``
    (what ``module.compile(backend=..., **options)`` would install)."""
    refuse_partitioner(partitioner)
    module._compiled_call_impl = _floats_specialized(context(module._call_impl))


def compile_module(module: torch.nn.Module, partitioner: PartitionerRecord, backend: Any,
                   compile_kwargs: dict[str, Any] | None, schedule: Any = None,
                   compiled_autograd_enabled: bool = False,
                   regions: list[torch.nn.Module] | None = None) -> None:
    """``engine.compile``'s work: check the partitioner and DeepSpeed's arguments zkit does not
    implement, then ``module.compile(backend=backend, **compile_kwargs)``; with ``regions`` (the
    partitioner's :meth:`~zkit.core.partitioner.Partitioner.compile_regions`) the forward of each
    region instead, its module hooks (the partitioner's gathers and releases) outside."""
    if regions is None:
        refuse_partitioner(partitioner)
    if schedule is not None:
        raise ValueError(_DEEPCOMPILE)
    if compiled_autograd_enabled:
        raise ValueError(_COMPILED_AUTOGRAD)
    kwargs = dict(compile_kwargs or {})
    if kwargs.pop("backend", backend) != backend:  # DeepSpeed's rule: the argument wins, with a warning
        log.warning("engine.compile: the backend in compile_kwargs is overridden by backend=%r", backend)
    if regions is None:
        module.compile(backend=backend, **kwargs)
        module._compiled_call_impl = _floats_specialized(module._compiled_call_impl)
        return
    compiled = []
    for region in regions:
        # the forward alone: Module.__call__ runs the hooks eagerly around it
        fast = _floats_specialized(torch.compile(region.forward, backend=backend, **kwargs))
        compiled.append((region, region.forward, fast))
        region.forward = fast
    module._zkit_compiled_regions = compiled


def _floats_specialized(compiled: Any) -> Any:
    """``compiled``, traced with Python floats as constants (``specialize_float``). A float that
    changes between calls (a dropout probability read as ``self.p``, scheduled) otherwise becomes
    a graph input the first time it changes, and this torch's Dynamo (2.13) crashes when a module
    reading it is checkpointed at two call sites: "lift_tracked_freevar_to_input should not be
    called on root SubgraphTracer" (pytorch/pytorch#193194). Specialized, each new value compiles
    once more, within Dynamo's recompile limit."""
    import torch._dynamo

    def call(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(specialize_float=True):
            return compiled(*args, **kwargs)

    return call


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module``'s calls go through ``torch.compile`` (whole, or region by region)."""
    return getattr(module, "_compiled_call_impl", None) is not None or bool(getattr(module, "_zkit_compiled_regions", ()))


@contextlib.contextmanager
def eager(module: torch.nn.Module) -> Iterator[None]:
    """Calls of ``module`` inside run uncompiled (see the module docstring: the FLOP probe)."""
    compiled = getattr(module, "_compiled_call_impl", None)
    regions = getattr(module, "_zkit_compiled_regions", ())
    if compiled is None and not regions:
        yield
        return
    module._compiled_call_impl = None
    for region, original, _ in regions:
        region.forward = original
    try:
        yield
    finally:
        module._compiled_call_impl = compiled
        for region, _, fast in regions:
            region.forward = fast
