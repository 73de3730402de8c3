"""``FusedAdamCUDA``: Adam/AdamW stepping every parameter in one Numba-CUDA launch.

At construction the parameters of each group are moved into flat buffers (the parameters become
views of them, as in DeepSpeed's flat fp16 optimizer), and ``exp_avg``/``exp_avg_sq`` are flat fp32
buffers whose per-parameter views are exposed in ``optimizer.state[p]`` under the names declared in
the optimizer record. 16-bit parameters get an fp32 master copy; fp32 parameters are their own
master. The gradients are copied into one flat buffer per step (one ``torch._foreach_copy_``), or
used in place when they already are views of it (after the first step, as long as
``zero_grad(set_to_none=False)`` keeps them).

``step()`` returns ``True`` when the update was applied and ``False`` when it was skipped because
a gradient was inf/NaN (checked, fused with the unscale, when ``grad_scale`` is given).

``state_dict()`` has torch Adam's layout (``exp_avg``, ``exp_avg_sq``, ``step`` per parameter), so
checkpoints move between this optimizer and ``torch.optim.Adam``/``AdamW``; ``load_state_dict``
copies the moments into the flat buffers (the state entries stay views of them, so the kernel
steps the loaded values) and refreshes the fp32 master of 16-bit parameters from the parameters.
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch

from zkit_cuda_numba import runtime

_CHUNK = 1 << 16


class FusedAdamCUDA(torch.optim.Optimizer):
    """Adam (``adam_w_mode=False``) or AdamW on flat buffers with one kernel launch per step.

    Args mirror ``torch.optim.AdamW``: ``lr``, ``betas``, ``eps``, ``weight_decay``; plus
    ``adam_w_mode`` (DeepSpeed's name; default True = decoupled weight decay).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, adam_w_mode: bool = True,
                 amsgrad: bool = False):
        if amsgrad:
            raise ValueError("FusedAdamCUDA does not implement amsgrad")
        if lr < 0 or eps <= 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or weight_decay < 0:
            raise ValueError(f"invalid Adam hyper-parameters: lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.adam_w_mode = bool(adam_w_mode)
        self.step_count = 0
        self._flatten()

    # -- set-up -------------------------------------------------------------------------------
    def _flatten(self) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
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
        total = sum(p.numel() for p in params)
        self.flat_params = torch.empty(total, dtype=dtype, device=device)
        self.flat_grads = torch.zeros(total, dtype=dtype, device=device)
        self.exp_avg = torch.zeros(total, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(total, dtype=torch.float32, device=device)
        starts, ends, groups = [], [], []
        offset = 0
        self._grad_views = []
        self._state_views = []
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                n = p.numel()
                self.flat_params[offset:offset + n].copy_(p.detach().reshape(-1))
                p.data = self.flat_params[offset:offset + n].view_as(p)
                self._grad_views.append(self.flat_grads[offset:offset + n].view_as(p))
                views = {"exp_avg": self.exp_avg[offset:offset + n].view_as(p),
                         "exp_avg_sq": self.exp_avg_sq[offset:offset + n].view_as(p)}
                self._state_views.append(views)
                self.state[p].update(views)
                for lo in range(offset, offset + n, _CHUNK):
                    starts.append(lo)
                    ends.append(min(lo + _CHUNK, offset + n))
                    groups.append(gi)
                offset += n
        self.master = self.flat_params if dtype == torch.float32 else self.flat_params.float()
        as_dev = lambda xs, dt: torch.tensor(xs, dtype=dt, device=device)  # noqa: E731
        self._chunks = (as_dev(starts, torch.int64), as_dev(ends, torch.int64),
                        as_dev(groups, torch.int32))
        self._found_inf = torch.zeros(1, dtype=torch.int32, device=device)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch Adam's layout: per parameter ``exp_avg``, ``exp_avg_sq`` (views of the flat
        buffers) and ``step``."""
        sd = super().state_dict()
        step = torch.tensor(float(self.step_count), device="cpu")  # torch Adam's layout: a host scalar
        sd["state"] = {i: {**st, "step": step} for i, st in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load hyper-parameters and moments (from this optimizer or torch's Adam/AdamW).

        The moments are copied into the flat fp32 buffers the kernel steps; a parameter without
        saved state starts from zero moments. All parameters must share one step count.
        """
        saved_state = state_dict["state"]
        super().load_state_dict(state_dict)  # hyper-parameters, group and size checks
        params = [p for g in self.param_groups for p in g["params"]]
        indices = [i for g in state_dict["param_groups"] for i in g["params"]]
        steps = set()
        for i, p, views in zip(indices, params, self._state_views):
            st = saved_state.get(i)
            for name, view in views.items():
                if st is None:
                    view.zero_()
                elif name not in st:
                    raise ValueError(f"FusedAdamCUDA.load_state_dict: parameter {i} has no {name!r} "
                                     f"in its state (keys: {sorted(st)})")
                else:
                    view.copy_(st[name])
            if st is not None:
                steps.add(int(st["step"]) if "step" in st else 0)
            self.state[p] = dict(views)  # views of the flat buffers, not the loaded copies
        if len(steps) > 1:
            raise ValueError(f"FusedAdamCUDA.load_state_dict: parameters have different step counts "
                             f"{sorted(steps)}; one flat optimizer steps them all together")
        self.step_count = steps.pop() if steps else 0
        if self.master is not self.flat_params:
            self.master.copy_(self.flat_params)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the flat gradient buffer in place (``set_to_none=True`` drops the gradients; the
        next step then copies them in again)."""
        self.flat_grads.zero_()
        params = [p for g in self.param_groups for p in g["params"]]
        for p, view in zip(params, self._grad_views):
            p.grad = None if set_to_none else view

    def _gather_grads(self, params) -> None:
        stale = [(p.grad, view) for p, view in zip(params, self._grad_views)
                 if p.grad is not None and p.grad.data_ptr() != view.data_ptr()]
        if stale:
            torch._foreach_copy_([v for _, v in stale], [g for g, _ in stale])
        for p, view in zip(params, self._grad_views):
            if p.grad is None:
                view.zero_()
            p.grad = view

    # -- step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, grad_scale: float | None = None) -> bool:
        """One update of every parameter. ``grad_scale``: the loss scale the gradients carry (they
        are unscaled and checked for inf/NaN in the same launches); returns False when skipped."""
        if closure is not None:
            raise ValueError("FusedAdamCUDA.step does not take a closure")
        runtime.require()
        from zkit_cuda_numba import adam_kernels as K

        params = [p for g in self.param_groups for p in g["params"]]
        self._gather_grads(params)
        device = self.flat_params.device
        stream = runtime.launch_stream(device)
        arr = runtime.as_kernel_array
        grads = self.flat_grads.float() if self.flat_grads.dtype == torch.bfloat16 else self.flat_grads
        self._found_inf.zero_()
        blocks = 4 if runtime.simulator_enabled() else 1024
        threads = 32 if runtime.simulator_enabled() else 256
        if grad_scale is not None:
            K.check_finite[blocks, threads, stream](arr(grads), grads.numel(), arr(self._found_inf))
        self.step_count += 1
        t = self.step_count
        hp = {k: [] for k in ("lr", "b1", "b2", "eps", "wd", "bc1", "bc2")}
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for key, val in (("lr", g["lr"]), ("b1", b1), ("b2", b2), ("eps", g["eps"]),
                             ("wd", g["weight_decay"]), ("bc1", 1 - b1 ** t), ("bc2", 1 - b2 ** t)):
                hp[key].append(val)
        hp_dev = {k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in hp.items()}
        write_half = self.flat_params.dtype == torch.float16
        half = self.flat_params if write_half else torch.zeros(1, dtype=torch.float16, device=device)
        start, end, group = self._chunks
        K.adam_step[min(blocks, start.numel()), threads, stream](
            arr(self.master), arr(grads), arr(self.exp_avg), arr(self.exp_avg_sq), arr(half),
            write_half, arr(start), arr(end), arr(group), arr(hp_dev["lr"]), arr(hp_dev["b1"]),
            arr(hp_dev["b2"]), arr(hp_dev["eps"]), arr(hp_dev["wd"]), arr(hp_dev["bc1"]),
            arr(hp_dev["bc2"]), self.adam_w_mode,
            np.float32(1.0 if grad_scale is None else 1.0 / grad_scale), arr(self._found_inf))
        skipped = bool(self._found_inf.item())
        if skipped:
            self.step_count -= 1
        elif self.flat_params.dtype == torch.bfloat16:
            self.flat_params.copy_(self.master)  # numba cannot store bf16: one torch cast
        return not skipped
