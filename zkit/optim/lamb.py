"""LAMB (You et al., "Large Batch Optimization for Deep Learning", arXiv:1904.00962) with the
semantics of DeepSpeed's ``FusedLamb``. One step is a few multi-tensor kernels per device and
dtype: torch's fused Adam kernel computes the moments and the Adam direction in one pass (CPU and
CUDA), ``torch._foreach`` ops do the rest (and everything on other devices), and nothing waits
for the device.

Per parameter ``p`` with gradient ``g`` (step ``t``)::

    m = b1 m + (1 - b1) g                    v = b2 v + (1 - b2) g^2
    m_hat = m / (1 - b1^t)                   v_hat = v / (1 - b2^t)      (bias_correction)
    u = m_hat / (sqrt(v_hat) + eps) + wd p   (eps_inside_sqrt: m_hat / sqrt(v_hat + eps) + wd p)
    r = clamp(||p|| / ||u||, min_coeff, max_coeff), or 1 when ||p|| or ||u|| is 0
    p = p - lr r u

The bias correction divides the moments themselves (the paper's Algorithm 2, and DeepSpeed's
kernel since it stopped folding ``sqrt(1 - b2^t) / (1 - b1^t)`` into the step size, which scaled
the already trust-ratio-normalised update). ``max_grad_norm > 0`` first scales the group's
gradients by ``max_grad_norm / (norm + 1e-6)`` when that is below 1, as ``FusedLamb`` does.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterable

import torch

from zkit.optim import params as check

_OWNER = "optimizer 'lamb'"
_FUSED_DEVICES = ("cpu", "cuda")


class Lamb(torch.optim.Optimizer):
    """Layer-wise adaptive moments: Adam's update rescaled per parameter by a trust ratio.

    Args:
        params: parameters or param-group dicts, as for any ``torch.optim.Optimizer``.
        lr: learning rate.
        bias_correction: divide the moments by ``1 - beta^t``.
        betas: decay rates of the first and second moments, each in ``[0, 1)``.
        eps: added to ``sqrt(v_hat)`` (or to ``v_hat`` under ``eps_inside_sqrt``).
        eps_inside_sqrt: use ``sqrt(v_hat + eps)`` in the denominator.
        weight_decay: L2 term added to the update before the trust ratio (decoupled from the
            moments, as in the paper).
        max_grad_norm: when > 0, clip each group's gradients to this global 2-norm first.
        max_coeff, min_coeff: bounds of the trust ratio.
        amsgrad: accepted for config compatibility; ``True`` is refused (LAMB has no AMSGrad).
        fused: compute the moments and Adam direction with torch's fused Adam kernel (one pass
            instead of eight); ``None`` picks it wherever it applies (CPU and CUDA,
            ``bias_correction=True``, ``eps_inside_sqrt=False``).

    The state per parameter is ``exp_avg``, ``exp_avg_sq`` (shaped like the parameter) and
    ``step`` (a CPU scalar tensor). The trust ratio needs whole-parameter norms, so a sharded
    engine must hand this optimizer whole parameters.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        fused: bool | None = None,
    ) -> None:
        if check.boolean(_OWNER, "amsgrad", amsgrad):
            raise ValueError(f"{_OWNER}: amsgrad=True is not supported; LAMB has no AMSGrad variant")
        defaults = dict(
            lr=check.number(_OWNER, "lr", lr, low=0.0),
            bias_correction=check.boolean(_OWNER, "bias_correction", bias_correction),
            betas=check.betas(_OWNER, betas),
            eps=check.number(_OWNER, "eps", eps, low=0.0),
            eps_inside_sqrt=check.boolean(_OWNER, "eps_inside_sqrt", eps_inside_sqrt),
            weight_decay=check.number(_OWNER, "weight_decay", weight_decay, low=0.0),
            max_grad_norm=check.number(_OWNER, "max_grad_norm", max_grad_norm, low=0.0),
            max_coeff=check.number(_OWNER, "max_coeff", max_coeff, low=0.0, low_open=True),
            min_coeff=check.number(_OWNER, "min_coeff", min_coeff, low=0.0, low_open=True),
            fused=None if fused is None else check.boolean(_OWNER, "fused", fused),
        )
        if fused and (eps_inside_sqrt or not bias_correction):
            raise ValueError(
                f"{_OWNER}: fused=True needs bias_correction=True and eps_inside_sqrt=False "
                f"(the fused kernel has no switch for either)"
            )
        if defaults["min_coeff"] > defaults["max_coeff"]:
            raise ValueError(
                f"{_OWNER}: min_coeff ({min_coeff}) must not exceed max_coeff ({max_coeff})"
            )
        super().__init__(params, defaults)
        self._lamb_coeffs: list[tuple[int, list[tuple[list[int], torch.Tensor]]]] = []
        self._workspace: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios of the last step, one per parameter that had a gradient, in
        param-group order (DeepSpeed's ``FusedLamb.get_lamb_coeffs``)."""
        out: list[float] = []
        for n, parts in self._lamb_coeffs:  # assembled here, so that step() never syncs
            coeffs = [0.0] * n
            for idx, ratio in parts:
                for i, c in zip(idx, ratio.tolist()):
                    coeffs[i] = float(c)
            out.extend(coeffs)
        return out

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        grad_norms: list[float | torch.Tensor] | None = None,
    ) -> Any:
        """One LAMB step. ``grad_norms`` (one per param group) overrides the gradient norm used
        by ``max_grad_norm``; an engine whose ranks each hold part of a group passes the global
        norm here, since the norm of the local gradients alone would clip differently per rank."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_norms is not None and len(grad_norms) != len(self.param_groups):
            raise ValueError(
                f"{_OWNER}: grad_norms has {len(grad_norms)} entries for {len(self.param_groups)} param groups"
            )
        self._lamb_coeffs = []
        for i, group in enumerate(self.param_groups):
            self._step_group(group, None if grad_norms is None else grad_norms[i])
        return loss

    def _step_group(self, group: dict[str, Any], grad_norm: float | torch.Tensor | None) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError(f"{_OWNER} does not support sparse gradients")
            if not torch.is_floating_point(p):
                raise RuntimeError(f"{_OWNER} needs floating-point parameters, got {p.dtype}")
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

        # Multi-tensor kernels need one device and dtype per list.
        buckets: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
        for i, p in enumerate(params):
            buckets[(p.device, p.dtype)].append(i)

        clip = self._clip_factor(group, params, grad_norm)
        parts = []
        for idx in buckets.values():
            bucket = [params[i] for i in idx]
            states = [self.state[p] for p in bucket]
            parts.append((idx, _step_bucket(group, bucket, states, clip, self._scratch(bucket))))
        self._lamb_coeffs.append((len(params), parts))

    def _scratch(self, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Reusable per-step scratch shaped like ``params`` (CPU only). Fresh large host
        allocations are page-faulted in on every step, which cost more than the step itself;
        CUDA's caching allocator has no such cost, so CUDA scratch stays transient."""
        p0 = params[0]
        if p0.device.type != "cpu":
            return None
        total = sum(p.numel() for p in params)
        key = (p0.device, p0.dtype)
        buf = self._workspace.get(key)
        if buf is None or buf.numel() < total:
            buf = self._workspace[key] = torch.empty(total, dtype=p0.dtype, device=p0.device)
        return [v.view_as(p) for v, p in zip(buf[:total].split([p.numel() for p in params]), params)]

    @staticmethod
    def _clip_factor(group, params, grad_norm) -> torch.Tensor | None:
        """``1 / max(1, (norm + 1e-6) / max_grad_norm)`` as a 0-dim tensor (no host sync), or None."""
        max_norm = group["max_grad_norm"]
        if max_norm <= 0:
            return None
        if grad_norm is None:
            per_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
            for p in params:
                per_device[p.device].append(p.grad)
            home = params[0].device
            sq = [_norms(g).square().sum().to(home, torch.float32 if home.type == "mps" else torch.float64)
                  for g in per_device.values()]
            grad_norm = torch.stack(sq).sum().sqrt()
        if not isinstance(grad_norm, torch.Tensor):
            grad_norm = torch.tensor(float(grad_norm), dtype=torch.float64)
        return 1.0 / torch.clamp((grad_norm + 1e-6) / max_norm, min=1.0)


def _norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of each tensor, stacked, accumulated in at least fp32 (one dtype per list)."""
    acc = torch.promote_types(tensors[0].dtype, torch.float32)
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=acc))


def _step_bucket(group: dict[str, Any], params: list[torch.Tensor], states: list[dict[str, Any]],
                 clip: torch.Tensor | None, scratch: list[torch.Tensor] | None) -> torch.Tensor:
    """Update one device/dtype bucket of a group in place and return its trust ratios."""
    grads = [p.grad for p in params]
    if clip is not None:
        # Fresh tensors: p.grad stays as the caller left it.
        grads = torch._foreach_mul(grads, clip.to(grads[0].dtype).to(grads[0].device, non_blocking=True))
    exp_avgs = [s["exp_avg"] for s in states]
    exp_avg_sqs = [s["exp_avg_sq"] for s in states]
    steps = [s["step"] for s in states]
    torch._foreach_add_(steps, 1.0)
    ts = [float(t) for t in steps]  # CPU scalars: no device sync

    fused = group.get("fused")  # absent from groups saved by DeepSpeed's FusedLamb
    if fused is None:
        fused = _fusable(group, params[0])
    elif fused and params[0].device.type not in _FUSED_DEVICES:
        raise RuntimeError(f"{_OWNER}: fused=True has no kernel for {params[0].device.type} parameters")
    if fused:
        neg_update = _neg_adam_direction_fused(group, params, grads, exp_avgs, exp_avg_sqs, ts, scratch)
    else:
        neg_update = _neg_adam_direction_foreach(group, grads, exp_avgs, exp_avg_sqs, ts, scratch)
    if group["weight_decay"] != 0:
        torch._foreach_add_(neg_update, params, alpha=-group["weight_decay"])

    w_norm, u_norm = _norms(params), _norms(neg_update)
    ratio = torch.where(
        (w_norm > 0) & (u_norm > 0),
        (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"]),
        torch.ones_like(w_norm),
    )
    scale = ratio * group["lr"]
    if params[0].device.type == "cpu":
        # Host scalars are free here: one fused multiply-add pass per parameter.
        for p, u, a in zip(params, neg_update, scale.tolist()):
            p.add_(u, alpha=a)
    else:
        # No device-to-host sync: scale by 0-dim device tensors, then add.
        torch._foreach_mul_(neg_update, list(scale.to(params[0].dtype).unbind()))
        torch._foreach_add_(params, neg_update)
    return ratio


def _fusable(group: dict[str, Any], p: torch.Tensor) -> bool:
    return group["bias_correction"] and not group.get("eps_inside_sqrt") and p.device.type in _FUSED_DEVICES


def _neg_adam_direction_fused(group, params, grads, exp_avgs, exp_avg_sqs, ts, scratch) -> list[torch.Tensor]:
    """Moments updated in place and ``-m_hat / (sqrt(v_hat) + eps)`` in one pass, by running
    torch's fused Adam kernel with ``lr=1`` on zero tensors (it then writes minus the Adam
    direction into them)."""
    beta1, beta2 = group["betas"]
    if scratch is None:
        out = [torch.zeros_like(p) for p in params]
    else:
        out = scratch
        torch._foreach_zero_(out)
    device = params[0].device
    # The kernel reads (and does not advance) one step tensor per parameter, on its device.
    # non_blocking: a blocking host-to-device copy would wait for the stream to drain.
    steps = list(torch.tensor(ts, dtype=torch.float32).to(device, non_blocking=True).unbind())
    torch._fused_adam_(
        out, grads, exp_avgs, exp_avg_sqs, [], steps,
        lr=1.0, beta1=beta1, beta2=beta2, weight_decay=0.0, eps=group["eps"],
        amsgrad=False, maximize=False, grad_scale=None, found_inf=None,
    )
    return out


def _neg_adam_direction_foreach(group, grads, exp_avgs, exp_avg_sqs, ts, scratch) -> list[torch.Tensor]:
    """The same with separate multi-tensor ops; also covers ``eps_inside_sqrt`` and
    ``bias_correction=False``, which the fused kernel has no switch for."""
    beta1, beta2 = group["betas"]
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    # Dividing by the negated correction yields -m_hat directly, saving a negation pass.
    bc1 = [-(1.0 - beta1**t) if group["bias_correction"] else -1.0 for t in ts]
    bc2 = [1.0 - beta2**t if group["bias_correction"] else 1.0 for t in ts]
    if scratch is None:
        neg = torch._foreach_div(exp_avgs, bc1)
    else:
        neg = scratch
        torch._foreach_copy_(neg, exp_avgs)
        torch._foreach_div_(neg, bc1)
    denom = torch._foreach_div(exp_avg_sqs, bc2)
    if group.get("eps_inside_sqrt"):
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_sqrt_(denom)
    else:
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, group["eps"])
    torch._foreach_div_(neg, denom)
    return neg
