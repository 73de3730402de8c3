"""Named ranges in ``torch.profiler`` traces: the engine's phases and ZeRO-3's per-module work.

A trace of one step (``with torch.profiler.profile(...)``) shows, on the host's timeline,
``zkit forward``, ``zkit backward``, ``zkit optimizer.step``, one ``zkit gather 'layers.3.mlp'``
per stage-3 gather (with its prefetches), ``zkit release 'layers.3.mlp'`` per release after a
module's forward and ``zkit reduce ...`` per gradient bucket: the host time of each module hook,
and the gaps between device kernels they leave.

A range is opened only while a profiler runs: ``record_function`` goes through the dispatcher
even with no profiler (tens of microseconds on a loaded CPU), the check costs a fraction of one.
Inside a region Dynamo traces, no range is opened (it would be traced into the graph, or break it).
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

PREFIX = "zkit "


def enabled() -> bool:
    """Whether a profiler is recording now (and this is not code Dynamo is tracing)."""
    return not torch.compiler.is_compiling() and torch.autograd._profiler_enabled()


def span(name: str, *args: Any) -> ContextManager[Any]:
    """A ``record_function`` range named ``"zkit " + name % args`` while a profiler records; else
    nothing (the name is not even formatted)."""
    if not enabled():
        return contextlib.nullcontext()
    return torch.autograd.profiler.record_function(PREFIX + (name % args if args else name))
