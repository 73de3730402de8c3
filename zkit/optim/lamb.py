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

Under ZeRO each rank holds *pieces* of parameters. After :meth:`Lamb.set_shard_norms` the norms are
assembled across ranks: every piece's sums of squares are scatter-added into a ``[2, num_params]``
tensor (rows: weight, update), one all-reduce sums it over the ranks, and each piece reads back the
norms of its whole parameter. The result equals LAMB on unsharded parameters.

Under tensor parallelism some parameters are *sliced* over a second group of ranks (each holds a
different part of the whole). After :meth:`Lamb.set_sliced_norms` the squared norms of those
parameters are also summed over that group (one more all-reduce of their columns only), and so is
the sliced part of each group's gradient norm for ``max_grad_norm``; parameters held whole on every
rank of that group count once.
"""
from __future__ import annotations

from collections import defaultdict
import operator
from typing import Any, Callable, Iterable, Sequence

import attrs
import torch

from zkit.core.config import params as check

_OWNER = "optimizer 'lamb'"
_FUSED_DEVICES = ("cpu", "cuda")


@attrs.frozen
class _ShardNorms:
    """How this rank's parameters map onto the model's: see :meth:`Lamb.set_shard_norms`."""

    index: tuple[int, ...]  # model parameter index of each optimizer parameter, param-group order
    num_params: int
    all_reduce: Callable[[torch.Tensor], None] | None  # over data-parallel pieces; None: none spread
    sliced: tuple[int, ...] = ()  # model indices of the parameters sliced over a second group
    sliced_all_reduce: Callable[[torch.Tensor], None] | None = None  # sums over that group


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
    ``step`` (a CPU scalar tensor). The trust ratio needs whole-parameter norms: an engine that
    hands this optimizer pieces of parameters calls :meth:`set_shard_norms` first.
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
        self._shard: _ShardNorms | None = None

    def set_shard_norms(
        self,
        param_index: Sequence[int],
        num_params: int,
        all_reduce: Callable[[torch.Tensor], None],
    ) -> None:
        """Step on pieces of parameters that are spread over data-parallel ranks.

        ``param_index[i]`` is the index (``0 .. num_params - 1``, the same numbering on every
        rank) of the model parameter that this optimizer's ``i``-th parameter, counted over
        ``param_groups`` in order, is a piece of. ``all_reduce(t)`` sums ``t`` in place over the
        ranks. From then on every :meth:`step` issues exactly one ``all_reduce`` of a
        ``[2, num_params]`` tensor (whole-parameter squared norms of weight and update), even on
        a rank with nothing to update, so every rank must call :meth:`step` every step. With
        ``max_grad_norm > 0`` in any group and no ``grad_norms`` passed, one ``all_reduce`` of the
        per-group squared gradient norms comes first: the clipped gradients feed the moments,
        so that norm is needed before the update exists and cannot share its collective.
        """
        index = self._mapping("set_shard_norms", param_index, num_params, all_reduce)
        old = self._shard
        if old is None:
            self._shard = _ShardNorms(index, num_params, all_reduce)
        else:  # a new mapping (param_groups changed); the sliced parameters stay
            if old.sliced and old.num_params != num_params:
                self._same_mapping("set_shard_norms", index, num_params)
            self._shard = attrs.evolve(old, index=index, num_params=num_params, all_reduce=all_reduce)

    def set_sliced_norms(
        self,
        param_index: Sequence[int],
        num_params: int,
        sliced: Iterable[int],
        all_reduce: Callable[[torch.Tensor], None],
    ) -> None:
        """Some model parameters are sliced over a second group of ranks (tensor parallelism):
        sum their squared norms over that group too, so the trust ratio sees whole parameters.

        ``param_index`` and ``num_params`` number the model parameters as for
        :meth:`set_shard_norms` (the same numbering when both are called, in either order; here
        also when this rank holds its parameters whole). ``sliced``: the indices of the sliced
        parameters, the same on every rank of the group. ``all_reduce(t)`` sums ``t`` in place
        over the group. From then on every :meth:`step` issues one more ``all_reduce`` (of a
        ``[2, len(sliced)]`` tensor), and with ``max_grad_norm > 0`` one more of the per-group
        squared norms of the sliced gradients, on every rank of the group."""
        index = self._mapping("set_sliced_norms", param_index, num_params, all_reduce)
        cols = set()
        for i in sliced:
            cols.add(self._index_of("set_sliced_norms", i, num_params))
        if self._shard is None or self._shard.all_reduce is None:
            shard = _ShardNorms(index, num_params, None)
        else:
            shard = self._same_mapping("set_sliced_norms", index, num_params)
        self._shard = attrs.evolve(shard, sliced=tuple(sorted(cols)), sliced_all_reduce=all_reduce)

    def _mapping(self, caller: str, param_index: Sequence[int], num_params: int,
                 all_reduce: Callable[[torch.Tensor], None]) -> tuple[int, ...]:
        if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 1:
            raise ValueError(f"{_OWNER}: {caller} needs num_params >= 1, got {num_params!r}")
        if not callable(all_reduce):
            raise TypeError(f"{_OWNER}: {caller} needs a callable all_reduce, got {all_reduce!r}")
        index = tuple(self._index_of(caller, i, num_params) for i in param_index)
        held = sum(len(g["params"]) for g in self.param_groups)
        if len(index) != held:
            raise ValueError(
                f"{_OWNER}: {caller} got {len(index)} parameter indices for the "
                f"{held} parameters in param_groups"
            )
        return index

    @staticmethod
    def _index_of(caller: str, i: Any, num_params: int) -> int:
        try:
            i = operator.index(i)
        except TypeError:
            raise TypeError(f"{_OWNER}: {caller}: parameter index {i!r} is not an integer") from None
        if not 0 <= i < num_params:
            raise ValueError(f"{_OWNER}: {caller}: parameter index {i} is outside 0..{num_params - 1}")
        return int(i)

    def _same_mapping(self, caller: str, index: tuple[int, ...], num_params: int) -> _ShardNorms:
        """The mapping already set, which a second call must repeat (both number one model)."""
        shard = self._shard
        if (shard.index, shard.num_params) != (index, num_params):
            raise ValueError(
                f"{_OWNER}: {caller} numbers the parameters differently from the earlier "
                f"set_shard_norms / set_sliced_norms call"
            )
        return shard

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
        if getattr(self, "_shard", None) is not None:
            self._step_sharded(self._shard, grad_norms)
            return loss
        for i, group in enumerate(self.param_groups):
            self._step_group(group, None if grad_norms is None else grad_norms[i])
        return loss

    def _step_group(self, group: dict[str, Any], grad_norm: float | torch.Tensor | None) -> None:
        params = self._prepare(group)
        if not params:
            return
        buckets = _buckets(params)
        clip = self._clip_factor(group, params, grad_norm)
        scratch = self._scratch([[params[i] for i in idx] for idx in buckets])
        parts = []
        for idx, space in zip(buckets, scratch):
            bucket = [params[i] for i in idx]
            states = [self.state[p] for p in bucket]
            neg_update = _neg_update(group, bucket, states, clip, space)
            parts.append((idx, _apply(group, bucket, neg_update, _norms(bucket), _norms(neg_update))))
        self._lamb_coeffs.append((len(params), parts))

    def _step_sharded(self, shard: _ShardNorms, grad_norms: list[float | torch.Tensor] | None) -> None:
        """The step on pieces: local partial sums, one all-reduce, whole-parameter norms back."""
        flat = [p for g in self.param_groups for p in g["params"]]
        if len(flat) != len(shard.index):
            raise RuntimeError(
                f"{_OWNER}: param_groups now hold {len(flat)} parameters but set_shard_norms mapped "
                f"{len(shard.index)}; call set_shard_norms again after changing param_groups"
            )
        model_index = {id(p): shard.index[i] for i, p in enumerate(flat)}
        home = flat[0].device
        acc = _accumulation_dtype(home)
        prepared = [(group, self._prepare(group)) for group in self.param_groups]

        sliced = set(shard.sliced)
        if grad_norms is None and any(g["max_grad_norm"] > 0 for g in self.param_groups):
            # Each piece belongs to one group, so a group's squared norm is the sum over ranks;
            # column 1 holds the slices, which are summed over the slicing group as well.
            sq = torch.zeros(len(prepared), 2, dtype=acc, device=home)
            for gi, (_, params) in enumerate(prepared):
                for idx in _buckets(params):
                    part = _norms([params[i].grad for i in idx]).to(home, acc).square()
                    cols = [int(model_index[id(params[i])] in sliced) for i in idx]
                    sq[gi].index_add_(0, torch.tensor(cols, device="cpu").to(home), part)
            self._all_reduce(shard, sq, torch.ones(1, dtype=torch.long, device=home) if sliced else None)
            grad_norms = list(sq.sum(1).sqrt_().unbind())

        work = []  # (group index, positions in the group, bucket): every bucket of every group
        clips = []
        for gi, (group, params) in enumerate(prepared):
            clips.append(self._clip_factor(group, params, None if grad_norms is None else grad_norms[gi]))
            for idx in _buckets(params):
                work.append((gi, idx, [params[i] for i in idx]))
        # Every update direction is held until the norms are known: one scratch for all groups.
        scratch = self._scratch([bucket for *_, bucket in work])
        sums = torch.zeros(2, shard.num_params, dtype=acc, device=home)
        updates = []
        for (gi, idx, bucket), space in zip(work, scratch):
            neg_update = _neg_update(prepared[gi][0], bucket, [self.state[p] for p in bucket], clips[gi], space)
            where = torch.tensor([model_index[id(p)] for p in bucket], device="cpu").to(home, non_blocking=True)
            partial = torch.stack([_norms(bucket), _norms(neg_update)]).to(home, acc).square()
            sums.index_add_(1, where, partial)  # pieces of one parameter add up
            updates.append((neg_update, where))
        # on every rank, every step: a rank holding nothing sends zeros
        self._all_reduce(shard, sums, torch.tensor(shard.sliced, device="cpu").to(home) if sliced else None)
        norms = sums.sqrt_()

        parts: list[list[tuple[list[int], torch.Tensor]]] = [[] for _ in prepared]
        for (gi, idx, bucket), (neg_update, where) in zip(work, updates):
            w_norm, u_norm = norms[:, where].to(bucket[0].device, _norm_dtype(bucket[0].dtype))
            parts[gi].append((idx, _apply(prepared[gi][0], bucket, neg_update, w_norm, u_norm)))
        self._lamb_coeffs = [(len(params), p) for (_, params), p in zip(prepared, parts) if params]

    @staticmethod
    def _all_reduce(shard: _ShardNorms, t: torch.Tensor, sliced_cols: torch.Tensor | None) -> None:
        """Sum ``t`` (``[k, n]``) over the pieces' ranks, then its ``sliced_cols`` over the slices'."""
        if shard.all_reduce is not None:
            shard.all_reduce(t)
        if sliced_cols is not None:
            part = t.index_select(1, sliced_cols)
            shard.sliced_all_reduce(part)
            t.index_copy_(1, sliced_cols, part)

    def _prepare(self, group: dict[str, Any]) -> list[torch.Tensor]:
        """The group's parameters that have a gradient, checked, with their state created."""
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError(f"{_OWNER} does not support sparse gradients")
            if not torch.is_floating_point(p):
                raise RuntimeError(f"{_OWNER} needs floating-point parameters, got {p.dtype}")
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")  # torch's Adam keeps it on the host
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return params

    def _scratch(self, buckets: list[list[torch.Tensor]]) -> list[list[torch.Tensor] | None]:
        """Reusable scratch shaped like each bucket (CPU only), disjoint across the buckets of
        one call. Fresh large host allocations are page-faulted in on every step, which cost
        more than the step itself; CUDA's caching allocator has no such cost, so CUDA scratch
        stays transient."""
        totals: dict[tuple[torch.device, torch.dtype], int] = defaultdict(int)
        for bucket in buckets:
            if bucket[0].device.type == "cpu":
                totals[(bucket[0].device, bucket[0].dtype)] += sum(p.numel() for p in bucket)
        for (device, dtype), total in totals.items():
            buf = self._workspace.get((device, dtype))
            if buf is None or buf.numel() < total:
                self._workspace[(device, dtype)] = torch.empty(total, dtype=dtype, device=device)
        used: dict[tuple[torch.device, torch.dtype], int] = defaultdict(int)
        out: list[list[torch.Tensor] | None] = []
        for bucket in buckets:
            key = (bucket[0].device, bucket[0].dtype)
            if key not in totals:
                out.append(None)
                continue
            sizes = [p.numel() for p in bucket]
            start = used[key]
            used[key] += sum(sizes)
            views = self._workspace[key][start : used[key]].split(sizes)
            out.append([v.view_as(p) for v, p in zip(views, bucket)])
        return out

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
            sq = [_norms(g).square().sum().to(home, _accumulation_dtype(home)) for g in per_device.values()]
            grad_norm = torch.stack(sq).sum().sqrt()
        if not isinstance(grad_norm, torch.Tensor):
            grad_norm = torch.tensor(float(grad_norm), dtype=torch.float64, device="cpu")
        return 1.0 / torch.clamp((grad_norm + 1e-6) / max_norm, min=1.0)


def _buckets(params: list[torch.Tensor]) -> list[list[int]]:
    """Positions of ``params`` split by device and dtype: multi-tensor kernels need one of each per list."""
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, p in enumerate(params):
        buckets[(p.device, p.dtype)].append(i)
    return list(buckets.values())


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _accumulation_dtype(device: torch.device) -> torch.dtype:
    """Squared norms summed over pieces and ranks: fp64 where the device has it."""
    return torch.float32 if device.type == "mps" else torch.float64


def _norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of each tensor, stacked, accumulated in at least fp32 (one dtype per list)."""
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=_norm_dtype(tensors[0].dtype)))


def _neg_update(group: dict[str, Any], params: list[torch.Tensor], states: list[dict[str, Any]],
                clip: torch.Tensor | None, scratch: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """Advance the moments of one device/dtype bucket and return minus its update ``u``."""
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
    return neg_update


def _apply(group: dict[str, Any], params: list[torch.Tensor], neg_update: list[torch.Tensor],
           w_norm: torch.Tensor, u_norm: torch.Tensor) -> torch.Tensor:
    """``p -= lr r u`` for one bucket, given the whole-parameter norms; returns the trust ratios."""
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
    steps = list(torch.tensor(ts, dtype=torch.float32, device="cpu").to(device, non_blocking=True).unbind())
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
