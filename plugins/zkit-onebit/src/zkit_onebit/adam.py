"""1-bit Adam (Tang et al., 2021, "1-bit Adam: Communication Efficient Large-Scale Training with
Adam's Convergence Speed"), with DeepSpeed's ``OneBitAdam`` parameters.

For ``freeze_step`` steps it is Adam (AdamW-style decoupled weight decay) on gradients that the
partitioner all-reduces in full precision. Then the variance ``exp_avg_sq`` is frozen: Adam's
update becomes linear in the momentum, and error-compensated 1-bit compression of what is
exchanged keeps the convergence. What is exchanged depends on how the states are partitioned:

* **ZeRO stage 0** (replicated states): each rank updates its momentum with its *local* gradient
  and the momenta are averaged with the two-phase compressed all-reduce (DeepSpeed's algorithm);
  the partitioner stops reducing gradients (it asks :attr:`OneBitAdam.needs_gradient_reduction`,
  the :class:`zkit.core.partitioner.ReductionPolicy` protocol), and the engine's gradient norm becomes
  the root mean square of the local norms (the plugin's ``zkit_grad_norm`` wrapper).
* **ZeRO stages 1 and 2** (sharded optimizer states): a rank holds the momentum of its shard only,
  so it cannot compress a full local momentum. Instead the partitioner keeps reducing gradients,
  through the engine's :class:`~zkit_onebit.communicator.OneBitCommunicator` (the optimizer's
  record asks the stack for the ``onebit`` communicator) whose reduce-scatter turns 1-bit at the
  freeze step, and each rank updates the momentum of its shard from
  the reduced gradient with the variance frozen. With the variance frozen the step is linear in the
  gradients, so worker-side error feedback compensates the compression as it does for momenta.
  The parameter all-gather of ZeRO stays in the model's dtype. Stage 3 is refused.

In every stage, an element whose variance is exactly zero at the freeze step (it never had a
gradient during warm-up) stays put afterwards: with a denominator of ``eps`` any later gradient
would move it by ``m / eps``, and, exchanged, would set the compression scale of its whole chunk.

The engine hands the optimizer its communicator: the optimizer record says
``needs_communicator=True``, so the factory receives ``comm=`` (the engine's data-parallel
communicator), and the plugin's ``zkit_engine_setup`` calls :meth:`OneBitAdam.attach` with the
partitioner.
"""
from __future__ import annotations

from typing import Any, Hashable, Iterable

import torch
import torch.distributed as dist

from zkit.core.communicator import Communicator
from zkit_onebit.collectives import compressed_all_reduce
from zkit_onebit.communicator import OneBitCommunicator
from zkit_onebit.compression import ChunkLayout, ErrorFeedback, LiveMask
from zkit_onebit.params import check_adam_values, check_names

COMM_BACKENDS = ("nccl", "gloo")
#: Momenta are flattened into buckets of at most this many elements per compressed all-reduce: one
#: collective pair per bucket, and bounded temporary memory (a few fp32 copies of one bucket).
DEFAULT_BUCKET_NUMEL = 1 << 25


class OneBitAdam(torch.optim.Optimizer):
    """1-bit Adam. ``params`` are torch-style params or param groups (the partitioner's masters).

    Parameters as DeepSpeed's ``OneBitAdam``: ``lr``, ``betas``, ``eps``, ``weight_decay``
    (decoupled, as DeepSpeed applies it), ``freeze_step`` (warm-up steps, >= 1),
    ``bias_correction`` (True: Adam's bias correction, and warm-up steps are bit-for-bit those of
    ``torch.optim.AdamW``; False: DeepSpeed's uncorrected update), ``eps_inside_sqrt``
    (``sqrt(v + eps)`` instead of ``sqrt(v) + eps``), ``cuda_aware`` (False stages packets of CUDA
    tensors through host memory when the backend is gloo; NCCL always sends from the device),
    ``comm_backend_name`` (``None``: the engine's communicator; ``"nccl"``/``"gloo"``: a process
    group of that backend over the same ranks carries the compressed momenta). ``amsgrad=True``
    and ``max_grad_norm > 0`` are refused (clip with the engine's ``gradient_clipping``).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        eps_inside_sqrt: bool = False,
        amsgrad: bool = False,
        max_grad_norm: float = 0.0,
        cuda_aware: bool = False,
        comm_backend_name: str | None = None,
        comm: Communicator | None = None,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    ) -> None:
        name = type(self).__name__
        check_adam_values(name, lr, betas, eps, weight_decay, freeze_step)
        if amsgrad:
            raise ValueError(f"{name} does not support amsgrad: the variance is frozen after freeze_step")
        if max_grad_norm:
            raise ValueError(
                f"{name}: max_grad_norm is not applied by the optimizer; clip gradients with the "
                f"config's 'gradient_clipping' instead (got max_grad_norm={max_grad_norm})"
            )
        if comm_backend_name is not None and comm_backend_name not in COMM_BACKENDS:
            raise ValueError(
                f"{name}: comm_backend_name must be one of {COMM_BACKENDS} (or left out to use the "
                f"engine's communicator), got {comm_backend_name!r}"
            )
        if comm_backend_name == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise ValueError(
                f"{name}: comm_backend_name='nccl' needs CUDA devices and NCCL, which this machine lacks; "
                f"use 'gloo' or leave comm_backend_name out"
            )
        if bucket_numel < 8:
            raise ValueError(f"{name}: bucket_numel must be >= 8, got {bucket_numel}")
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt,
        )
        super().__init__(params, defaults)
        self.freeze_step = freeze_step
        self.cuda_aware = cuda_aware
        self.comm_backend_name = comm_backend_name
        self.bucket_numel = bucket_numel
        self.comm = comm
        #: optimizer steps taken (warm-up and compressed).
        self.step_count = 0
        #: True once the variance is frozen and compressed exchange has started.
        self.frozen = False
        #: "momentum" (ZeRO 0: compressed momentum all-reduce) or "gradients" (ZeRO 1/2).
        self.exchange = "momentum"
        self.partitioner: Any = None
        self._grad_comm: OneBitCommunicator | None = None
        self._momentum_comm: Communicator | None = None
        self._feedback: dict[Hashable, ErrorFeedback] = {}
        #: per momentum bucket: the elements with a non-zero frozen variance (None: all of them).
        self._masks: dict[Hashable, LiveMask | None] = {}
        self._dead: dict[int, bool] = {}
        self._pending_feedback: dict[str, Any] = {}
        self._flat: dict[int, torch.Tensor] = {}

    # -- integration ------------------------------------------------------------------------------
    @property
    def needs_gradient_reduction(self) -> bool:
        """Whether gradients must reach :meth:`step` averaged over ranks: True during warm-up
        (and always under ZeRO 1/2); False once momenta are exchanged compressed."""
        return not (self.frozen and self.exchange == "momentum")

    def attach(self, partitioner: Any) -> None:
        """Bind to the engine's partitioner: choose what is exchanged from its ZeRO stage. The
        partitioner asks :attr:`needs_gradient_reduction` whether to reduce; at ZeRO 1 and 2 its
        communicator (the ``onebit`` one, which the optimizer record asks the stack for) turns
        1-bit at the freeze step."""
        stage = partitioner.stage or 0
        name = type(self).__name__
        if stage >= 3:
            raise ValueError(
                f"{name} supports ZeRO stages 0, 1 and 2, not stage {stage}: stage 3 gathers parameters "
                f"layer by layer, and the compressed exchange needs the whole gradient of a step at once"
            )
        comm = partitioner.comm
        self.partitioner = partitioner
        if self.comm is None:
            self.comm = comm
        if stage == 0:
            self.exchange = "momentum"
            if isinstance(comm, OneBitCommunicator):
                comm.set_compression(False)  # warm-up gradients exact; then momenta, not gradients
        else:
            if not isinstance(comm, OneBitCommunicator):
                raise ValueError(
                    f"{name} at ZeRO stage {stage} reduces its gradients 1-bit compressed through the 'onebit' "
                    f"communicator, but this engine's communicator is a {type(comm).__name__} (chosen with "
                    f"zkit.Stack(communicator=...)); leave the communicator unchosen or choose 'onebit'"
                )
            self.exchange = "gradients"
            self._grad_comm = comm
            if self._pending_feedback.get("gradients"):
                comm.load_state_dict(self._pending_feedback["gradients"])
        self._apply_phase()

    def _stage_on_host(self, comm: Communicator | None) -> bool:
        backend = getattr(comm, "backend", None)
        return backend == "gloo" and not self.cuda_aware and torch.cuda.is_available()

    def _apply_phase(self) -> None:
        if self.exchange == "gradients" and self._grad_comm is not None:
            self._grad_comm.set_compression(self.frozen)

    def _momentum_transport(self) -> Communicator | None:
        if self._momentum_comm is not None:
            return self._momentum_comm
        comm = self.comm  # a OneBitCommunicator passes its all-to-all and all-gather on, counted
        if comm is None:
            if dist.is_initialized() and dist.get_world_size() > 1:
                raise RuntimeError(
                    f"{type(self).__name__} has no communicator for its compressed exchange: the engine passes "
                    f"comm= to its record's factory; outside the engine pass comm= (a zkit Communicator)"
                )
            return None
        name = self.comm_backend_name
        if name is not None and name != getattr(comm, "backend", name) and comm.world_size > 1:
            # a sibling of the engine's transport over the same ranks, on the backend asked for
            transport = getattr(comm, "transport", comm)
            group = getattr(transport, "group", None)
            ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
            comm = transport.subgroup(ranks, backend=name)
        self._momentum_comm = comm
        return comm

    # -- step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.frozen:
            self._compressed_step()
        else:
            self._warmup_step()
        self.step_count += 1
        if not self.frozen and self.step_count >= self.freeze_step:
            self.frozen = True
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state[p]
                    if "step" in state:
                        state["variance_step"] = state["step"].clone()
            self._apply_phase()
        return loss

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _warmup_step(self) -> None:
        # The operations and their order are those of torch.optim.AdamW's single-tensor path, so
        # warm-up is bit-for-bit AdamW.
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p)
                state["step"] += 1
                if group["weight_decay"] != 0:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                step = state["step"].item()
                self._update(p, group, state, step, step)

    def _step_size_and_denom(
        self, group: dict, state: dict, step: float, var_step: float
    ) -> tuple[float, torch.Tensor]:
        beta1, beta2 = group["betas"]
        if group["bias_correction"]:
            bias_correction2 = 1 - beta2**var_step
            step_size = group["lr"] / (1 - beta1**step)
        else:
            bias_correction2 = 1.0
            step_size = group["lr"]
        if group["eps_inside_sqrt"]:
            denom = (state["exp_avg_sq"] / bias_correction2).add_(group["eps"]).sqrt_()
        else:
            denom = (state["exp_avg_sq"].sqrt() / bias_correction2**0.5).add_(group["eps"])
        return step_size, denom

    def _update(self, p: torch.Tensor, group: dict, state: dict, step: float, var_step: float) -> None:
        step_size, denom = self._step_size_and_denom(group, state, step, var_step)
        p.addcdiv_(state["exp_avg"], denom, value=-step_size)

    def _compressed_step(self) -> None:
        params: list[tuple[torch.Tensor, dict, dict]] = []
        for group in self.param_groups:
            beta1 = group["betas"][0]
            for p in group["params"]:
                state = self._state(p)
                # Every rank must exchange the same momenta: a missing gradient is a zero gradient.
                if p.grad is not None:
                    state["exp_avg"].lerp_(p.grad, 1 - beta1)
                else:
                    state["exp_avg"].mul_(beta1)
                state["step"] += 1
                params.append((p, group, state))
        frozen = float(self.freeze_step)
        if self.exchange == "momentum":
            self._preconditioned_exchange(params)
            return
        # ZeRO 1/2: the gradient arrived reduced (1-bit); an element that never had a gradient
        # during warm-up has no variance to scale its compression noise by: it stays put.
        for p, group, state in params:
            if group["weight_decay"] != 0:
                p.mul_(1 - group["lr"] * group["weight_decay"])
            var_step = state.get("variance_step", torch.tensor(frozen, device="cpu")).item()
            step_size, denom = self._step_size_and_denom(group, state, state["step"].item(), var_step)
            denom.masked_fill_(state["exp_avg_sq"] == 0, float("inf"))
            p.addcdiv_(state["exp_avg"], denom, value=-step_size)

    def _preconditioned_exchange(self, params: list[tuple[torch.Tensor, dict, dict]]) -> None:
        """Average the momenta *divided by the frozen Adam denominator*, compressed.

        The denominator ``sqrt(v) + eps`` is frozen and identical on every rank, so averaging
        ``m / denom`` is averaging ``m``. But ``m / denom`` is Adam's update direction, of the
        same magnitude in every layer, so one scale per chunk fits all its elements, and the
        compression noise an element receives is never amplified by a tiny variance: every
        element moves at most about ``lr`` per step, as in Adam. (Compressing ``m`` itself, as
        DeepSpeed does, gives an element with ``v`` near zero a step of ``scale / eps``.)
        """
        denoms = []
        for p, group, state in params:
            var_step = state.get("variance_step", torch.tensor(float(self.freeze_step), device="cpu")).item()
            step_size, denom = self._step_size_and_denom(group, state, state["step"].item(), var_step)
            dead = self._has_dead_elements(p, state)
            if dead:
                # v == 0: no gradient in warm-up. m / inf = 0: the element stays put (see _live_mask).
                denom.masked_fill_(state["exp_avg_sq"] == 0, float("inf"))
            state["exp_avg"].div_(denom)  # the exchanged buffers now hold m / denom
            denoms.append((step_size, denom, dead))
        self._exchange_momenta([state for _, _, state in params])
        for (p, group, state), (step_size, denom, dead) in zip(params, denoms):
            if group["weight_decay"] != 0:
                p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(state["exp_avg"], alpha=-step_size)
            if dead:
                denom.nan_to_num_(posinf=0.0)  # the momentum of a dead element is 0, not 0 * inf
            state["exp_avg"].mul_(denom)  # back to the momentum

    def _has_dead_elements(self, p: torch.Tensor, state: dict) -> bool:
        """Whether some element of ``p`` has a frozen variance of exactly zero (cached: the
        variance no longer changes)."""
        dead = self._dead.get(id(p))
        if dead is None:
            dead = self._dead[id(p)] = bool((state["exp_avg_sq"] == 0).any())
        return dead

    def _exchange_momenta(self, states: list[dict]) -> None:
        """Average the momenta over ranks in place, compressed, in flat buckets; elements with
        ``v = 0`` are left out (see :func:`_live_mask`)."""
        transport = self._momentum_transport()
        if transport is None or transport.world_size == 1:
            return
        host = self._stage_on_host(transport)
        for index, bucket in enumerate(self._buckets(states)):
            self._all_reduce_bucket(transport, f"momentum/{index}", self._flat_momenta(index, bucket), bucket, host)

    def _all_reduce_bucket(
        self, transport: Communicator, key: str, flat: torch.Tensor, bucket: list[dict], host: bool
    ) -> None:
        """Compressed average of one flat bucket in place, with the error buffers of ``key``
        (created zero, or from a loaded checkpoint) and the bucket's live mask."""
        layout = ChunkLayout.for_all_reduce(flat.numel(), transport.world_size)
        fb = self._feedback_for(key, layout, flat.device)
        if key not in self._masks:
            self._masks[key] = _live_mask(layout, bucket)
        compressed_all_reduce(transport, flat, fb, op="avg", stage_on_host=host, mask=self._masks[key])

    def _feedback_for(self, key: str, layout: ChunkLayout, device: torch.device) -> ErrorFeedback:
        """The error buffers of ``key``: created zero, or from a loaded checkpoint."""
        fb = self._feedback.get(key)
        if fb is None or fb.layout != layout:
            fb = self._feedback[key] = ErrorFeedback.zeros(layout, device, with_server=True)
            if key in self._pending_feedback.get("momentum", {}):
                fb.load_state_dict(self._pending_feedback["momentum"].pop(key))
        return fb

    def _flat_momenta(self, index: int, bucket: list[dict]) -> torch.Tensor:
        """One flat tensor whose slices *are* the bucket's momenta, so the exchange needs no
        gathering copy. Built once; rebuilt if the states were replaced (a loaded state dict)."""
        momenta = [state["exp_avg"] for state in bucket]
        if len(momenta) == 1 and momenta[0].is_contiguous():
            return momenta[0].view(-1)
        flat = self._flat.get(index)
        if flat is not None and flat.numel() == sum(m.numel() for m in momenta):
            offset, ok = 0, True
            for m in momenta:
                if not m.is_contiguous() or m.data_ptr() != flat[offset:].data_ptr():
                    ok = False
                    break
                offset += m.numel()
            if ok:
                return flat
        flat = torch.cat([m.reshape(-1) for m in momenta])
        offset = 0
        for state, m in zip(bucket, momenta):
            state["exp_avg"] = flat[offset : offset + m.numel()].view(m.shape)
            offset += m.numel()
        self._flat[index] = flat
        return flat

    def _buckets(self, states: list[dict]) -> list[list[dict]]:
        """Consecutive states whose momenta share device and dtype, at most ``bucket_numel``
        elements each (a larger tensor is a bucket of its own)."""
        buckets: list[list[dict]] = []
        size = 0
        for state in states:
            m = state["exp_avg"]
            last = buckets[-1][0]["exp_avg"] if buckets else None
            if last is None or last.device != m.device or last.dtype != m.dtype or size + m.numel() > self.bucket_numel:
                buckets.append([state])
                size = m.numel()
            else:
                buckets[-1].append(state)
                size += m.numel()
        return buckets

    # -- state ----------------------------------------------------------------------------------
    def onebit_state_dict(self) -> dict[str, Any]:
        """This rank's 1-bit state: phase, step count and error-feedback buffers (rank-specific,
        so stored in each rank's checkpoint, not resharded)."""
        out: dict[str, Any] = {
            "step_count": self.step_count,
            "frozen": self.frozen,
            "momentum": {k: fb.state_dict() for k, fb in self._feedback.items()},
        }
        if self._grad_comm is not None:
            out["gradients"] = self._grad_comm.state_dict()
        return out

    def load_onebit_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = int(state["step_count"])
        self.frozen = bool(state["frozen"])
        self._feedback.clear()
        self._masks.clear()
        self._dead.clear()
        self._pending_feedback = {"momentum": dict(state.get("momentum", {})), "gradients": state.get("gradients")}
        if self._grad_comm is not None and state.get("gradients"):
            self._grad_comm.load_state_dict(state["gradients"])
        self._apply_phase()

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["onebit"] = self.onebit_state_dict()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        onebit = state_dict.pop("onebit", None)
        super().load_state_dict(state_dict)
        if onebit is not None:
            self.load_onebit_state_dict(onebit)


def _live_mask(layout: ChunkLayout, bucket: list[dict]) -> LiveMask | None:
    """The elements of a momentum bucket whose frozen variance is non-zero; None if all are.

    An element that never had a gradient during warm-up has ``v = 0``: its Adam denominator is
    ``eps``, so any momentum it received (1-bit compression cannot send an exact zero, and a
    gradient may reach it later) would move it by ``m / eps``. Such elements are kept out of the
    exchange and stay put, as DeepSpeed's ``exp_avg_mask`` does for elements the user names."""
    live = torch.cat([(state["exp_avg_sq"] != 0).reshape(-1) for state in bucket])
    if bool(live.all()):
        return None
    return LiveMask.from_flat(layout, live)


#: DeepSpeed's parameter names (plus ``bucket_numel``) that the config may give.
ONEBIT_ADAM_PARAMS = (
    "lr", "betas", "eps", "weight_decay", "freeze_step", "bias_correction", "eps_inside_sqrt",
    "amsgrad", "max_grad_norm", "cuda_aware", "comm_backend_name", "bucket_numel",
)


def make_onebit_adam(param_groups: list[dict[str, Any]], comm: Communicator | None = None, **params: Any) -> OneBitAdam:
    """Factory of the ``onebitadam`` optimizer record: checks the config's parameter names;
    ``comm`` is the engine's (the record needs a communicator)."""
    check_names("OneBitAdam", params, ONEBIT_ADAM_PARAMS)
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    return OneBitAdam(param_groups, comm=comm, **params)
