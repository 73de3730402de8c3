"""What one training micro-step costs: FLOPs and activation memory, measured once.

The engine runs its first training micro-step (the first forward with gradients enabled and the
backward that follows) under :class:`StepProbe`. The shapes of later micro-steps are the same, so
one count serves the whole run, and only that micro-step pays for the measuring:

* FLOPs: torch's own :class:`torch.utils.flop_counter.FlopCounterMode` over forward and backward,
  rather than a formula per model. With activation checkpointing the recomputation in backward is
  counted too: the figure is what the hardware executed.
* activation peak, on CUDA: ``torch.cuda.max_memory_allocated()`` during the forward minus the
  memory allocated when it started (the CUDA peak statistics are reset at its start). It includes
  the forward's temporaries, and at ZeRO stage 3 the parameters gathered for it.
* activation peak, on the CPU (no allocator statistics there): the bytes autograd saves for
  backward during the forward, counted through saved-tensor hooks, each storage once, parameters
  and buffers excluded. This is what the forward leaves for backward, the quantity activation
  checkpointing reduces; temporaries freed within the forward are not included.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.utils.flop_counter import FlopCounterMode

from zkit.core.compile import eager


class StepProbe:
    """Measures the first training micro-step of ``module``; see the module docstring.

    ``flops`` (forward + backward of one micro-step on this rank) and ``activation_bytes`` stay
    ``None`` until that micro-step's backward has run.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.flops: int | None = None
        self.activation_bytes: int | None = None
        self._forward_flops: int | None = None  # a counted forward waiting for its backward
        self._forward_activation_bytes = 0

    @property
    def done(self) -> bool:
        return self.flops is not None

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Around the model's forward. Counts it unless already done or gradients are disabled
        (evaluation); a second forward before any backward replaces the first one's count."""
        if self.done or not torch.is_grad_enabled():
            yield
            return
        counter = FlopCounterMode(display=False)
        memory = _CudaPeak() if _on_cuda(self.module) else _SavedBytes(self.module)
        # Dynamo refuses frames under a dispatch mode for good: a compiled module runs this one eagerly
        with memory, counter, eager(self.module):
            yield
        self._forward_flops = counter.get_total_flops()
        self._forward_activation_bytes = memory.nbytes

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Around the backward pass; completes the measurement after a counted forward."""
        if self.done or self._forward_flops is None:
            yield
            return
        counter = FlopCounterMode(display=False)
        # a checkpoint eager around a compiled region (stage 3 compiles block by block) calls the
        # region's compiled forward again in backward: under the dispatch mode Dynamo would refuse
        # that forward for good, and it would run uncompiled for the rest of the run
        with counter, eager(self.module):
            yield
        self.flops = self._forward_flops + counter.get_total_flops()
        self.activation_bytes = self._forward_activation_bytes

    def metrics(self, step_time_s: float, micro_steps_per_step: int) -> dict[str, float]:
        """``step_flops`` (this rank's FLOPs per optimizer step) and ``flops_per_s`` (achieved,
        from the mean step time); empty until measured."""
        if self.flops is None:
            return {}
        step_flops = float(self.flops * micro_steps_per_step)
        out = {"step_flops": step_flops}
        if step_time_s > 0:
            out["flops_per_s"] = step_flops / step_time_s
        return out


def _on_cuda(module: torch.nn.Module) -> bool:
    first = next(module.parameters(), None)
    return first is not None and first.device.type == "cuda"


class _CudaPeak:
    """Peak CUDA memory allocated above the level at entry."""

    nbytes = 0

    def __enter__(self) -> "_CudaPeak":
        torch.cuda.reset_peak_memory_stats()
        self._start = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.nbytes = max(0, torch.cuda.max_memory_allocated() - self._start)


class _SavedBytes:
    """Bytes of the storages autograd saves for backward inside the block, each counted once.

    The hooks pass every tensor on to the saved-tensor hooks that were active before them (ZeRO
    stage 3 installs its own to gather parameters again in backward), so they change nothing.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._skip = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
        self._seen: dict[int, int] = {}
        self.nbytes = 0

    def _pack(self, t: torch.Tensor) -> Any:
        base = t._base if t._base is not None else t
        is_param = isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)
        if not is_param and t.device.type != "meta":
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._skip:
                self._seen[storage.data_ptr()] = storage.nbytes()
        return self._outer[0](t) if self._outer is not None else t

    def _unpack(self, packed: Any) -> Any:
        return self._outer[1](packed) if self._outer is not None else packed

    def __enter__(self) -> "_SavedBytes":
        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self.nbytes = sum(self._seen.values())
