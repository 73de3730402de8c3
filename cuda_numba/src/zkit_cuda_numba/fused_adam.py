"""``FusedAdamCUDA``: Adam/AdamW stepping every parameter of a flat buffer in one Numba-CUDA launch.

Where the parameters live. The kernel steps flat buffers through a chunk table, so the parameters
must be views of flat buffers:

* By default the parameters of every group are moved into one flat buffer (they become views of
  it, as in DeepSpeed's flat fp16 optimizer), unless they already are contiguous views of one
  buffer, back to back in order: that buffer is then stepped where it is, nothing is copied.
* ``in_place=True`` never moves a parameter: each buffer the parameters view is stepped where it
  is, one launch per buffer, the elements between parameters left untouched. The engine's record
  builds the optimizer so, because the ZeRO partitioner hands it views of its fp32 master
  (``torch.nn.Parameter(master[a:b])``), then reads the master back, loads checkpoints into it and
  publishes it into the model: a parameter moved into another buffer would leave the master stale
  and training would stop without an error.

``exp_avg``/``exp_avg_sq`` are fp32 buffers laid out like each parameter buffer; their
per-parameter views, with ``step``, are ``optimizer.state[p]`` under the names the optimizer record
declares. 16-bit parameters get an fp32 master copy; fp32 parameters are their own master.
Gradients are read where they are when they lie in one buffer laid out like the parameters (ZeRO's
gradient shards, or this optimizer's own gradient buffer after the first step as long as
``zero_grad(set_to_none=False)`` keeps them); otherwise they are copied into the optimizer's
gradient buffer with one ``torch._foreach_copy_``.

Stepping. ``step(grad_scale=s)`` unscales the gradients in the kernel and checks them for inf/NaN
(fused: the update kernel reads the flag on the device); it returns ``False`` when the step was
skipped. ``fused_step`` is zkit's :class:`~zkit.optim.fused_step.FusedStepOptimizer` protocol: the
partitioner's loss-scale unscaling and gradient clipping arrive as one ``grad_factor`` that the
kernel multiplies each gradient by as it reads it, so no pass over the gradients precedes the step.

Checkpoints. ``state_dict()`` has torch Adam's layout (``exp_avg``, ``exp_avg_sq``, ``step`` per
parameter), so checkpoints move between this optimizer and ``torch.optim.Adam``/``AdamW``. State
put into ``optimizer.state[p]`` from outside, by ``load_state_dict`` or by zkit's checkpoint loader
(which assigns each piece's state), is copied into the flat buffers before the next step (the
entries become views of them again) and the fp32 master of 16-bit parameters is refreshed from the
parameters.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from zkit_cuda_numba import runtime

_CHUNK = 1 << 16
_TWIN_DTYPES = (torch.float16, torch.bfloat16)
_STATE_NAMES = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass
class FlatBuffer:
    """One flat buffer the kernel steps in one launch; every tensor here has its layout.

    ``params``: the parameters' values (the caller's buffer, or one the optimizer made), model
    dtype. ``master``: fp32, ``params`` itself or a copy. ``grads``: the optimizer's own gradient
    buffer (model dtype). ``members``: ``(parameter, offset)`` in chunk order, and ``grad_views``
    each member's view of ``grads``. ``chunks``: the chunk table (start, end, param group), on the
    device."""

    params: torch.Tensor
    master: torch.Tensor
    grads: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    members: list[tuple[torch.Tensor, int]]
    grad_views: list[torch.Tensor]
    chunks: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    def spans(self) -> list[tuple[int, int]]:
        return [(off, off + p.numel()) for p, off in self.members]


def _one_buffer(tensors: Sequence[torch.Tensor], gaps: bool) -> tuple[torch.Tensor, list[int]] | None:
    """``(flat, offsets)`` when ``tensors`` are contiguous views of one storage in increasing,
    non-overlapping order (back to back unless ``gaps``): ``flat`` is a 1-D view of that storage
    from the first one's start to the last one's end and ``offsets`` where each starts in it.
    ``None`` otherwise."""
    first = tensors[0]
    storage, base = first.untyped_storage().data_ptr(), first.storage_offset()
    offsets, end = [], base
    for t in tensors:
        start = t.storage_offset()
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage or start < end:
            return None
        if not gaps and start != end:
            return None
        offsets.append(start - base)
        end = start + t.numel()
    return first.detach().as_strided((end - base,), (1,), base), offsets


def _of_the_only_buffer(field: str) -> property:
    """A :class:`FlatBuffer` tensor as an optimizer attribute, for the default layout's one buffer
    (an error naming the count when there are several)."""
    get = operator.attrgetter(field)
    return property(lambda self: get(self._only()), doc=f"``{field}`` of the one flat buffer")


class FusedAdamCUDA(torch.optim.Optimizer):
    """Adam (``adam_w_mode=False``) or AdamW on flat buffers with one kernel launch per buffer.

    Args mirror ``torch.optim.AdamW``: ``lr``, ``betas``, ``eps``, ``weight_decay``; plus
    ``adam_w_mode`` (DeepSpeed's name; default True = decoupled weight decay) and ``in_place``
    (step the parameters in the buffers they view, never moving them: see the module docstring).
    """

    #: zkit.optim.fused_step: the partitioner hands this optimizer its gradient factor
    fuses = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, adam_w_mode: bool = True,
                 amsgrad: bool = False, in_place: bool = False):
        if amsgrad:
            raise ValueError("FusedAdamCUDA does not implement amsgrad")
        if lr < 0 or eps <= 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or weight_decay < 0:
            raise ValueError(f"invalid Adam hyper-parameters: lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.adam_w_mode = bool(adam_w_mode)
        self.in_place = bool(in_place)
        self.step_count = 0
        #: what the last step ran (zkit.optim.fused_step; the engine's step log shows it)
        self.last_kernel = "no step yet"
        self._copy_out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._build()

    # -- set-up -------------------------------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _build(self) -> None:
        device = self._device = self._check_params()
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        #: the flat buffers the kernel steps, one launch each
        self.buffers = [self._flat_buffer(flat, members, group_of) for flat, members in self._layout()]
        where = {id(p): (buf, off, grad_view)
                 for buf in self.buffers for (p, off), grad_view in zip(buf.members, buf.grad_views)}
        #: per parameter, in param-group order: its gradient view and its state views
        self._grad_views: list[torch.Tensor | None] = []
        self._state_views: list[dict[str, torch.Tensor]] = []
        for p in self._params():
            if id(p) in where:
                buf, off, grad_view = where[id(p)]
                self._grad_views.append(grad_view)
                self._state_views.append({name: getattr(buf, name)[off:off + p.numel()].view_as(p)
                                          for name in _STATE_NAMES})
            else:  # an empty parameter (a ZeRO rank owning nothing holds one): nothing to step
                self._grad_views.append(None)
                self._state_views.append({name: torch.zeros(p.shape, dtype=torch.float32, device=device)
                                          for name in _STATE_NAMES})
        self._step = torch.zeros((), dtype=torch.float32, device="cpu")  # torch Adam's layout: a host scalar
        for p, views in zip(self._params(), self._state_views):
            self.state[p] = {**views, "step": self._step}
        self._found_inf = torch.zeros(1, dtype=torch.int32, device=device)
        self._no_half = torch.zeros(1, dtype=torch.float16, device=device)

    def _check_params(self) -> torch.device:
        """The one device every parameter is on (with one floating dtype), or an error naming why not."""
        params = self._params()
        if not params:
            raise ValueError("FusedAdamCUDA got no parameters")
        device = params[0].device
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1 or any(p.device != device for p in params):
            raise ValueError("FusedAdamCUDA needs every parameter on one device with one dtype, got "
                             f"{sorted(map(str, dtypes))} on {sorted({str(p.device) for p in params})}")
        dtype = dtypes.pop()
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"FusedAdamCUDA steps fp32, fp16 or bf16 parameters, got {dtype}")
        if device.type != "cuda" and not runtime.simulator_enabled():
            raise ValueError(
                f"FusedAdamCUDA steps tensors on a CUDA device; its parameters are on {device}. A master kept "
                "in host memory (zero_optimization.offload_optimizer) needs a CPU optimizer: there the config "
                "type 'Adam' is stepped by zkit-offload's fused CPU Adam")
        return device

    def _layout(self) -> list[tuple[torch.Tensor, list[tuple[torch.Tensor, int]]]]:
        """The flat buffers to step and their ``(parameter, offset)`` members."""
        params = [p for p in self._params() if p.numel() > 0]
        if not params:
            return []
        if self.in_place:
            by_storage: dict[int, list[torch.Tensor]] = {}
            for p in params:
                by_storage.setdefault(p.untyped_storage().data_ptr(), []).append(p)
            out = []
            for members in by_storage.values():
                members.sort(key=lambda t: t.storage_offset())
                found = _one_buffer(members, gaps=True)
                if found is None:
                    raise ValueError("FusedAdamCUDA(in_place=True) steps parameters where they are, so they "
                                     "must be contiguous and must not overlap; some sharing a buffer are not")
                out.append((found[0], list(zip(members, found[1]))))
            return out
        found = _one_buffer(params, gaps=False)
        if found is not None:  # already one flat buffer, in order: step it where it is
            return [(found[0], list(zip(params, found[1])))]
        flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        members, offset = [], 0
        for p in params:
            flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = flat[offset:offset + p.numel()].view_as(p)
            members.append((p, offset))
            offset += p.numel()
        return [(flat, members)]

    def _flat_buffer(self, flat: torch.Tensor, members: list[tuple[torch.Tensor, int]],
                     group_of: dict[int, int]) -> FlatBuffer:
        device, n = flat.device, flat.numel()
        starts, ends, groups = [], [], []
        for p, off in members:
            for lo in range(off, off + p.numel(), _CHUNK):
                starts.append(lo)
                ends.append(min(lo + _CHUNK, off + p.numel()))
                groups.append(group_of[id(p)])
        grads = torch.zeros(n, dtype=flat.dtype, device=device)
        return FlatBuffer(
            params=flat,
            master=flat if flat.dtype == torch.float32 else flat.float(),
            grads=grads,
            exp_avg=torch.zeros(n, dtype=torch.float32, device=device),
            exp_avg_sq=torch.zeros(n, dtype=torch.float32, device=device),
            members=members,
            grad_views=[grads[off:off + p.numel()].view_as(p) for p, off in members],
            chunks=(torch.tensor(starts, dtype=torch.int64, device=device),
                    torch.tensor(ends, dtype=torch.int64, device=device),
                    torch.tensor(groups, dtype=torch.int32, device=device)),
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "buffers"):
            raise ValueError("FusedAdamCUDA steps the flat buffers it built at construction; build a new "
                             "optimizer to add a parameter group")
        super().add_param_group(param_group)

    # -- the single-buffer view (the default layout) ----------------------------------------------
    def _only(self) -> FlatBuffer:
        if len(self.buffers) != 1:
            raise ValueError(f"FusedAdamCUDA steps {len(self.buffers)} flat buffers; read them in .buffers")
        return self.buffers[0]

    flat_params = _of_the_only_buffer("params")
    flat_grads = _of_the_only_buffer("grads")
    master = _of_the_only_buffer("master")
    exp_avg = _of_the_only_buffer("exp_avg")
    exp_avg_sq = _of_the_only_buffer("exp_avg_sq")

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch Adam's layout: per parameter ``exp_avg``, ``exp_avg_sq`` (views of the flat
        buffers) and ``step`` (a host scalar of its own, not the optimizer's live counter)."""
        self._adopt_state()
        sd = super().state_dict()
        sd["state"] = {i: {**st, "step": self._step.clone()} for i, st in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load hyper-parameters and moments (from this optimizer or torch's Adam/AdamW); a
        parameter without saved state starts from zero moments. All parameters must share one step
        count."""
        super().load_state_dict(state_dict)  # hyper-parameters, group and size checks
        # torch casts the moments to the parameters' dtype: the fp32 buffers take the saved values
        saved = state_dict["state"]
        indices = [i for g in state_dict["param_groups"] for i in g["params"]]
        for i, p in zip(indices, self._params()):
            if i in saved:
                self.state[p] = dict(saved[i])
        self._adopt_state()

    def _adopt_state(self) -> None:
        """Copy state entries that are not this optimizer's views into the flat buffers, and make
        the entries views again (the kernel steps the buffers, not what ``state`` holds)."""
        steps: set[int] = set()
        replaced = intact = False
        for i, (p, views) in enumerate(zip(self._params(), self._state_views)):
            st = self.state[p]
            if st.get("step") is self._step and all(st.get(n) is v for n, v in views.items()):
                intact = True
                continue
            replaced = True
            for name, view in views.items():
                if st and name not in st:
                    raise ValueError(f"FusedAdamCUDA: the state of parameter {i} has no {name!r} "
                                     f"(keys: {sorted(st)})")
                if not st:
                    view.zero_()
                elif st[name] is not view:
                    view.copy_(st[name].reshape(view.shape))
            if st:
                steps.add(int(st["step"]) if "step" in st else 0)
            self.state[p] = {**views, "step": self._step}
        if not replaced:
            return
        if intact:  # entries left alone keep stepping with the others
            steps.add(self.step_count)
        if len(steps) > 1:
            raise ValueError(f"FusedAdamCUDA: parameters have different step counts {sorted(steps)}; one flat "
                             "optimizer steps them all together")
        self.step_count = steps.pop() if steps else 0
        self._step.fill_(self.step_count)
        for buf in self.buffers:  # the parameters hold the loaded weights
            if buf.master is not buf.params:
                buf.master.copy_(buf.params)

    # -- gradients ------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the flat gradient buffers in place (``set_to_none=True`` drops the gradients; the
        next step then copies them in again)."""
        for buf in self.buffers:
            buf.grads.zero_()
        for p, view in zip(self._params(), self._grad_views):
            p.grad = None if set_to_none else view

    @staticmethod
    def _kernel_grads(buf: FlatBuffer) -> torch.Tensor:
        """The flat gradient the kernel reads for ``buf``: the gradients' own buffer when they lie
        in one laid out like the parameters (nothing copied), else the optimizer's, copied into
        (the gradients then become views of it; a missing gradient is zero)."""
        grads = [p.grad for p, _ in buf.members]
        if all(g is not None and g.dtype == buf.grads.dtype and g.device == buf.grads.device for g in grads):
            found = _one_buffer(grads, gaps=True)
            if found is not None and found[1] == [off for _, off in buf.members]:
                return _widened(found[0])
        stale = [(g, view) for g, view in zip(grads, buf.grad_views)
                 if g is not None and g.data_ptr() != view.data_ptr()]
        if stale:
            torch._foreach_copy_([view for _, view in stale], [g for g, _ in stale])
        for (p, _), g, view in zip(buf.members, grads, buf.grad_views):
            if g is None:
                view.zero_()
            p.grad = view
        return _widened(buf.grads)

    # -- step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, grad_scale: float | None = None) -> bool:
        """One update of every parameter. ``grad_scale``: the loss scale the gradients carry (they
        are unscaled and checked for inf/NaN in the same launches); returns False when skipped."""
        if closure is not None:
            raise ValueError("FusedAdamCUDA.step does not take a closure")
        factor = 1.0 if grad_scale is None else 1.0 / grad_scale
        return self._run(factor, check=grad_scale is not None)

    @torch.no_grad()
    def fused_step(self, grad_factor: float = 1.0, check_overflow: bool = False) -> bool:
        """One update with every gradient multiplied by ``grad_factor`` as the kernel reads it
        (zkit's partitioner passes the loss scale's inverse times the clipping coefficient). With
        ``check_overflow`` the gradients are first checked for inf/NaN (fused: no host round trip
        before the update, which does nothing when the flag is set) and ``False`` is returned when
        the step was skipped; nothing is changed then. Returns whether the step was applied."""
        return self._run(grad_factor, check=check_overflow)

    def _run(self, factor: float, check: bool) -> bool:
        runtime.require()
        from zkit_cuda_numba import adam_kernels as K

        self._adopt_state()
        sim = runtime.simulator_enabled()
        blocks, threads = (4, 32) if sim else (1024, 256)
        arr = runtime.as_kernel_array
        stream = runtime.launch_stream(self._device)
        work = [(buf, self._kernel_grads(buf)) for buf in self.buffers]
        self._found_inf.zero_()
        if check:
            for buf, grads in work:
                start, end, _ = buf.chunks
                K.check_finite[min(blocks, start.numel()), threads, stream](
                    arr(grads), arr(start), arr(end), arr(self._found_inf))
        hp = [arr(row) for row in self._hyper_parameters(self.step_count + 1)]
        for buf, grads in work:
            write_half = buf.params.dtype == torch.float16
            start, end, group = buf.chunks
            K.adam_step[min(blocks, start.numel()), threads, stream](
                arr(buf.master), arr(grads), arr(buf.exp_avg), arr(buf.exp_avg_sq),
                arr(buf.params if write_half else self._no_half), write_half, arr(start), arr(end), arr(group),
                *hp, self.adam_w_mode, np.float32(factor), arr(self._found_inf))
        self.last_kernel = self._describe(factor, check)
        if check and bool(self._found_inf.item()):
            return False
        self.step_count += 1
        self._step.fill_(self.step_count)
        for buf in self.buffers:
            if buf.params.dtype == torch.bfloat16:  # numba cannot store bf16: one torch cast
                torch._foreach_copy_([buf.params[a:b] for a, b in buf.spans()],
                                     [buf.master[a:b] for a, b in buf.spans()])
        if self._copy_out:
            twins = list(self._copy_out.values())
            torch._foreach_copy_([t.view(-1) for _, t in twins], [p.detach().view(-1) for p, _ in twins])
        return True

    def _hyper_parameters(self, t: int) -> torch.Tensor:
        """Rows lr, beta1, beta2, eps, weight decay, bias corrections 1 and 2; one column per
        group; one host-to-device copy."""
        cols = []
        for g in self.param_groups:
            b1, b2 = g["betas"]
            cols.append((g["lr"], b1, b2, g["eps"], g["weight_decay"], 1 - b1 ** t, 1 - b2 ** t))
        return torch.tensor(cols, dtype=torch.float32, device=self._device).t().contiguous()

    def _describe(self, factor: float, check: bool) -> str:
        twins = sorted({str(t.dtype).replace("torch.", "") for _, t in self._copy_out.values()})
        return (f"Numba-CUDA adam_step ({'AdamW' if self.adam_w_mode else 'Adam'}, gradient x {factor:g} in the "
                f"kernel{', inf/NaN check fused' if check else ''}, {len(self.buffers)} launch(es)"
                + "".join(f", {d} copy-out" for d in twins) + ")")

    # -- 16-bit twins ---------------------------------------------------------------------------
    def attach_copy_out(self, param: torch.Tensor, target: torch.Tensor | None) -> None:
        """After every applied step, write ``param``'s updated value into ``target`` (fp16 or bf16,
        on the parameter's device, same number of elements); ``None`` detaches.

        All twins are written by one ``torch._foreach_copy_`` after the kernel, not inside it: the
        kernel's 16-bit output is indexed like the master, and a twin elsewhere is not laid out
        like it. zkit's partitioner attaches twins only in host memory (CPU offload), where on a GPU
        this optimizer does not step; it attaches them under the CUDA simulator."""
        if not any(param is q for q in self._params()):
            raise ValueError("attach_copy_out: the parameter is not one this optimizer steps")
        if target is None:
            self._copy_out.pop(id(param), None)
            return
        if target.dtype not in _TWIN_DTYPES:
            raise TypeError(f"attach_copy_out: the target must be torch.float16 or torch.bfloat16, "
                            f"got {target.dtype}")
        if target.device != param.device or not target.is_contiguous():
            raise ValueError(f"attach_copy_out: the target must be contiguous on the parameter's device "
                             f"{param.device}, got one on {target.device} (contiguous={target.is_contiguous()})")
        if target.numel() != param.numel():
            raise ValueError(f"attach_copy_out: the target has {target.numel()} elements, the parameter "
                             f"{param.numel()}")
        self._copy_out[id(param)] = (param, target)


def _widened(flat: torch.Tensor) -> torch.Tensor:
    return flat.float() if flat.dtype == torch.bfloat16 else flat  # numba has no bf16 arrays
