"""The base of the fused CPU optimizers: a ``torch.optim.Optimizer`` whose step is one Numba pass.

What the base adds to ``torch.optim.Optimizer``:

* **Checks.** Parameters, gradients and state must be contiguous fp32 tensors on the CPU (the
  kernels work on flat buffers); anything else is refused with a message naming the parameter.
* **Fused extras** on :meth:`FusedCPUOptimizer.fused_step`: ``grad_factor`` multiplies every
  gradient as it is read (fp16 loss-scale unscaling and clipping in one number), and
  ``check_overflow`` first runs one read-only pass over the gradients; if any is inf/nan the step
  is skipped and parameters and state are left exactly as they were.
* **16-bit copy-out.** :meth:`attach_copy_out` gives a parameter an fp16/bf16 twin that every
  step writes in the same pass (the low-precision weights of mixed-precision training).
* :meth:`grad_stats` returns the squared gradient norm and the inf/nan count in one pass, for an
  engine that clips by the global norm and must agree on overflow across ranks before stepping.

Subclasses define ``_state_names`` (``state_dict`` keys, torch's where torch has the optimizer),
``_check_group`` and ``_update`` (one kernel launch for one parameter), and may step a group's
parameters in one launch (``_steps_together`` and ``_update_together``: a multi-tensor kernel).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import numpy as np
import torch

from zkit_offload import kernels
from zkit_offload.numba_setup import launch_lock, layer_is_threadsafe

_OUT_KIND = {torch.float16: kernels.OUT_FP16, torch.bfloat16: kernels.OUT_BF16}
_NO_OUT = np.empty(0, dtype=np.uint16)

# torch.optim keys that a state_dict saved by a torch optimizer brings along; harmless when off.
_TORCH_FLAGS_OFF = ("foreach", "capturable", "differentiable", "fused")


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """Zero-copy flat numpy view of a contiguous CPU tensor (16-bit floats as uint16 bits)."""
    flat = t.detach().view(-1)
    if flat.dtype in (torch.float16, torch.bfloat16):
        return flat.view(torch.int16).numpy().view(np.uint16)
    return flat.numpy()


def f32(x: float | torch.Tensor) -> np.float32:
    return np.float32(float(x))


def launch(kernel: Callable[..., Any], *args: Any) -> Any:
    """Run a parallel kernel; serialised when Numba's threading layer is not thread-safe."""
    threads = torch.get_num_threads()
    try:
        if layer_is_threadsafe():
            return kernel(*args)
        with launch_lock:
            return kernel(*args)
    finally:
        # Numba's OpenMP pool, as it starts, sets the process's OpenMP thread count to its own
        # size, which torch's intra-op pool shares: each rank's torch would then run on every core.
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


class FusedCPUOptimizer(torch.optim.Optimizer):
    """Base class; see the module docstring."""

    _state_names: tuple[str, ...] = ()
    #: whether an engine should hand this optimizer the gradient factor and 16-bit copy-out
    #: (zkit.optim.fused_step); a subclass that runs another library's kernel says False
    fuses = True

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        self._copy_out: dict[int, torch.Tensor] = {}
        #: Whether the last :meth:`step` was applied (False: skipped because of inf/nan gradients).
        self.last_step_applied = True
        #: What the last step ran (zkit.optim.fused_step.FusedStepOptimizer; the engine logs it).
        self.last_kernel = "no step yet"
        #: id(tensor) -> (weak reference, data pointer, numpy view): see :meth:`array`
        self._arrays: dict[int, tuple[Any, int, np.ndarray]] = {}
        #: during a step, id(buffer) -> (buffer, numpy view) of the buffers gradients are slices of
        self._grad_bases: dict[int, tuple[torch.Tensor, np.ndarray]] = {}
        for group in self.param_groups:
            self._check_group(group)
            for p in group["params"]:
                self._check_param(p, layout=False)

    # -- hooks for subclasses -------------------------------------------------------------------
    def _check_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _update(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any], out: np.ndarray,
                out_kind: int, grad_factor: np.float32) -> None:
        raise NotImplementedError

    def _steps_together(self, group: dict[str, Any], grad_factor: np.float32) -> bool:
        """Whether :meth:`_update_together` steps ``group``'s parameters without a copy-out in one
        launch (a multi-tensor kernel: one dispatch per group rather than one per parameter)."""
        return False

    def _update_together(self, group: dict[str, Any], members: list[tuple[torch.Tensor, dict[str, Any]]],
                         grad_factor: np.float32) -> None:
        raise NotImplementedError

    def _init_state(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")
        for name in self._state_names:
            state[name] = torch.zeros_like(p, memory_format=torch.contiguous_format)

    # -- public API -------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_copy_out"):  # a group added after construction
            self._check_group(self.param_groups[-1])
            for p in self.param_groups[-1]["params"]:
                self._check_param(p, layout=False)

    def attach_copy_out(self, param: torch.Tensor, target: torch.Tensor | None) -> None:
        """Write ``param``'s updated value into ``target`` (fp16 or bf16, contiguous, on the CPU,
        same number of elements) in every step's pass. ``None`` detaches."""
        if not any(param is q for g in self.param_groups for q in g["params"]):
            raise ValueError("attach_copy_out: the parameter is not one this optimizer steps")
        if target is None:
            self._copy_out.pop(id(param), None)
            return
        if target.dtype not in _OUT_KIND:
            raise TypeError(f"attach_copy_out: the target must be torch.float16 or torch.bfloat16, got {target.dtype}")
        if target.device.type != "cpu" or not target.is_contiguous():
            raise ValueError(
                f"attach_copy_out: the target must be a contiguous CPU tensor, got one on {target.device} "
                f"(contiguous={target.is_contiguous()}); copy it to the device after the step"
            )
        if target.numel() != param.numel():
            raise ValueError(
                f"attach_copy_out: the target has {target.numel()} elements, the parameter {param.numel()}"
            )
        self._copy_out[id(param)] = target

    @torch.no_grad()
    def grad_stats(self, grad_factor: float = 1.0) -> tuple[float, int]:
        """``(sum of squares of grad*grad_factor, number of inf/nan gradient elements)`` over every
        parameter with a gradient, in one read-only pass (fp64 accumulation)."""
        return self._stats(list(self._with_grads()), f32(grad_factor))

    # -- numpy views: host tensors read without torch ops per parameter and step ----------------
    def array(self, t: torch.Tensor) -> np.ndarray:
        """A flat numpy view of ``t``, a tensor that lives across steps (a parameter, a state
        tensor, a copy-out target), made once per tensor and memory: :func:`as_numpy` is three
        torch ops, for every parameter at every step otherwise."""
        key, ptr = id(t), t.data_ptr()
        entry = self._arrays.get(key)
        if entry is None or entry[0]() is not t or entry[1] != ptr or entry[2].size != t.numel():
            # forgotten with the tensor (a state tensor a checkpoint load replaced)
            ref = weakref.ref(t, lambda _, key=key, arrays=self._arrays: arrays.pop(key, None))
            entry = self._arrays[key] = (ref, ptr, as_numpy(t))
        return entry[2]

    def grad_array(self, p: torch.Tensor) -> np.ndarray:
        """``p.grad`` as a flat numpy view, through the buffer it is a slice of (a ZeRO stage's
        gradient shard): one view per buffer and step rather than one per parameter."""
        g = p.grad
        base = g._base if g._base is not None else g
        if base.dtype != g.dtype or base.requires_grad or not (base.is_contiguous() and g.is_contiguous()):
            return as_numpy(g)
        entry = self._grad_bases.get(id(base))
        if entry is None:
            entry = self._grad_bases[id(base)] = (base, base.numpy().reshape(-1))
        start = g.storage_offset() - base.storage_offset()
        return entry[1][start : start + g.numel()]

    def step_count(self, state: dict[str, Any]) -> float:
        """The parameter's step count, read on the host from its state tensor's memory."""
        return float(self.array(state["step"])[0])

    def _stats(self, todo: list[tuple[torch.Tensor, dict[str, Any]]], factor: np.float32) -> tuple[float, int]:
        sumsq, bad = 0.0, 0
        for p, _group in todo:
            g = self.grad_array(p)
            s, b = launch(kernels.grad_stats, g, g.view(np.uint32), factor)
            sumsq += s
            bad += b
        return sumsq, int(bad)

    @torch.no_grad()
    def fused_step(self, grad_factor: float = 1.0, check_overflow: bool = False,
                   params: Iterable[torch.Tensor] | None = None) -> bool:
        """One step with every gradient multiplied by ``grad_factor`` as it is read. With
        ``check_overflow`` the gradients are checked first and, if any element is inf or nan,
        nothing is changed and ``False`` is returned. Returns whether the step was applied.
        ``params`` restricts the step to some parameters (one NVMe sub-group at a time)."""
        try:
            return self._fused_step(grad_factor, check_overflow, params)
        finally:
            self._grad_bases = {}  # the gradients' buffers are the step's

    def _fused_step(self, grad_factor: float, check_overflow: bool, params: Iterable[torch.Tensor] | None) -> bool:
        todo = list(self._with_grads())
        if params is not None:
            wanted = {id(p) for p in params}
            todo = [(p, g) for p, g in todo if id(p) in wanted]
        if check_overflow and self._stats(todo, f32(1.0))[1]:
            self.last_step_applied = False
            return False
        factor = f32(grad_factor)
        outs = sorted({str(t.dtype).replace("torch.", "") for t in self._copy_out.values()})
        self.last_kernel = (
            f"Numba fused pass (gradient x {float(factor):g}, {type(self).__name__} update"
            + "".join(f", {o} copy-out" for o in outs) + ")"
        )
        together: dict[int, tuple[dict[str, Any], list[tuple[torch.Tensor, dict[str, Any]]]]] = {}
        for p, group in todo:
            state = self.state[p]
            if not state:
                self._init_state(group, p, state)
            self._prepare_state(p, state)
            self.array(state["step"])[0] += 1  # in the tensor's memory, without a torch op
            target = self._copy_out.get(id(p))
            if target is None and self._steps_together(group, factor):
                together.setdefault(id(group), (group, []))[1].append((p, state))
                continue
            out_kind = _OUT_KIND[target.dtype] if target is not None else kernels.OUT_NONE
            if out_kind == kernels.OUT_FP16 and not kernels.HARDWARE_HALF:
                self._update(group, p, state, _NO_OUT, kernels.OUT_NONE, factor)
                target.view(-1).copy_(p.detach().view(-1))
                continue
            self._update(group, p, state, self.array(target) if target is not None else _NO_OUT, out_kind, factor)
        for group, members in together.values():
            self._update_together(group, members, factor)
        self.last_step_applied = True
        return True

    def step(self, closure: Callable[[], Any] | None = None, *, grad_factor: float = 1.0,
             check_overflow: bool = False) -> Any:
        """``torch.optim.Optimizer.step``; ``grad_factor`` and ``check_overflow`` as in
        :meth:`fused_step` (whether the step was applied is in :attr:`last_step_applied`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.fused_step(grad_factor=grad_factor, check_overflow=check_overflow)
        return loss

    # -- internals --------------------------------------------------------------------------------
    def _with_grads(self) -> Iterable[tuple[torch.Tensor, dict[str, Any]]]:
        for index, group in enumerate(self.param_groups):
            self._check_group(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._check_param(p)
                g = p.grad
                if g.is_sparse or g.dtype != torch.float32 or g.device.type != "cpu" or not g.is_contiguous():
                    raise ValueError(
                        f"{type(self).__name__}: the gradient of a parameter of shape {tuple(p.shape)} in group "
                        f"{index} is {'sparse' if g.is_sparse else g.dtype} on {g.device} "
                        f"(contiguous={g.is_contiguous()}); a contiguous dense fp32 CPU gradient is required"
                    )
                yield p, group

    def _check_param(self, p: torch.Tensor, layout: bool = True) -> None:
        # Contiguity is checked when a parameter is stepped: an NVMe-swapped master's parameters
        # are zero-stride placeholders between steps (zkit_offload.swapped_master).
        if p.dtype != torch.float32 or p.device.type != "cpu" or (layout and not p.is_contiguous()):
            raise ValueError(
                f"{type(self).__name__} steps contiguous fp32 parameters on the CPU; got a parameter of shape "
                f"{tuple(p.shape)}, {p.dtype} on {p.device} (contiguous={p.is_contiguous()}). Keep an fp32 "
                "master copy on the host (zkit's 'host' allocator does) and step that."
            )

    def _prepare_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        """State loaded from a checkpoint may be non-contiguous or a Python number: normalise."""
        if not torch.is_tensor(state["step"]):
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32, device="cpu")
        for name in self._state_names:
            t = state[name]
            if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.shape != p.shape:
                state[name] = t.to(device="cpu", dtype=torch.float32).reshape(p.shape).contiguous()

    @staticmethod
    def _check_flags(group: dict[str, Any], name: str) -> None:
        for flag in _TORCH_FLAGS_OFF:
            if group.get(flag):
                raise ValueError(f"{name} does not support {flag}={group[flag]!r} (a parameter group sets it)")
        if group.get("maximize"):
            raise ValueError(f"{name} does not support maximize=True; negate the loss instead")
