"""0/1 Adam (Lu et al., 2022, "Maximizing Communication Efficiency for Large-scale Training via
0/1 Adam"), with DeepSpeed's ``ZeroOneAdam`` parameters. ZeRO stage 0.

Where 1-bit Adam freezes the variance once, 0/1 Adam keeps refreshing it on a schedule that
thins out, and later stops communicating on most steps:

* **Steps ``1 .. var_freeze_step``.** On a *variance step* (``t % var_interval == 0``) the
  gradient arrives all-reduced in full precision and both moments are updated, as in Adam. On
  every other step the local gradient is averaged with the 1-bit compressed all-reduce (worker
  and server error feedback) and only the momentum is updated. ``var_interval`` starts at 1 and
  doubles after every ``var_update_scaler`` variance steps.
* **After ``var_freeze_step``** the variance is frozen and ranks take *local steps* with their
  local gradients and no communication. Every ``local_step_interval`` steps the ranks average,
  compressed, how far their parameters moved since the last synchronisation, all move to the
  last synchronisation point plus that average, and the momentum is re-estimated from it
  (``m = -delta * d / sum(step sizes)``). ``local_step_interval`` starts at 1 and doubles every
  ``local_step_scaler`` steps, up to ``local_step_clipper``.

As for 1-bit Adam, what is compressed is divided by the Adam denominator ``d = sqrt(v) + eps``
(the gradient in the first phase; parameter moves already are), so one scale per chunk fits a
bucket spanning many layers. When a variance step changes ``d``, the error buffers are rescaled
elementwise by ``d_old / d_new``, so the error they carry keeps its meaning. Elements with
``v = 0`` are kept out of the exchange and do not move (see :func:`zkit_onebit.adam._live_mask`).
The parameters synchronised at the last averaging are kept in ``state["sync_params"]``: every rank
lands on ``sync_params + average``, so replicas stay bit-identical.

ZeRO stages 1-3 are refused: local steps need every rank to hold the whole optimizer state.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from zkit.core.communicator import Communicator
from zkit_onebit.adam import DEFAULT_BUCKET_NUMEL, OneBitAdam
from zkit_onebit.compression import ChunkLayout
from zkit_onebit.params import check_adam_values, check_names, check_positive_ints


class ZeroOneAdam(OneBitAdam):
    """0/1 Adam. Parameters as DeepSpeed's ``ZeroOneAdam``: ``lr``, ``betas``, ``eps``,
    ``weight_decay`` (decoupled), ``bias_correction`` (True: Adam's, the variance corrected by the
    number of variance updates; False: DeepSpeed's uncorrected update), ``var_freeze_step``,
    ``var_update_scaler``, ``local_step_scaler``, ``local_step_clipper``, ``eps_inside_sqrt``,
    ``cuda_aware``, ``comm_backend_name``; ``amsgrad`` and ``max_grad_norm`` as for
    :class:`OneBitAdam`."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
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
        check_adam_values(name, lr, betas, eps, weight_decay)
        check_positive_ints(
            name, var_freeze_step=var_freeze_step, var_update_scaler=var_update_scaler,
            local_step_scaler=local_step_scaler, local_step_clipper=local_step_clipper,
        )
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, freeze_step=var_freeze_step,
            bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt, amsgrad=amsgrad,
            max_grad_norm=max_grad_norm, cuda_aware=cuda_aware, comm_backend_name=comm_backend_name,
            comm=comm, bucket_numel=bucket_numel,
        )
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        #: the schedule: variance steps every ``var_interval`` steps, ``var_counter`` of them at
        #: this interval so far, ``var_updates`` in all; local steps synchronise every
        #: ``local_interval`` steps (``local_counter`` steps taken at this interval); ``lrs``: per
        #: param group, the step sizes summed since the last synchronisation.
        self.var_interval, self.var_counter, self.var_updates = 1, 0, 0
        self.local_interval, self.local_counter = 1, 0
        self.lrs = [0.0] * len(self.param_groups)

    # -- integration ------------------------------------------------------------------------------
    @property
    def needs_gradient_reduction(self) -> bool:
        """True when the next step is a variance step (full-precision averaged gradient)."""
        return not self.frozen and (self.step_count + 1) % self.var_interval == 0

    def attach(self, partitioner: Any) -> None:
        stage = getattr(partitioner, "stage", 0) or 0
        if stage != 0:
            raise ValueError(
                f"{type(self).__name__} supports ZeRO stage 0 only, not stage {stage}: its local steps "
                f"need every rank to hold the whole optimizer state (use OneBitAdam under ZeRO 1 or 2)"
            )
        super().attach(partitioner)

    # -- step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t = self.step_count + 1
        params = self._params()
        if self.frozen:
            self._local_step(params, t)
            self.local_counter += 1
            if self.local_counter == self.local_step_scaler:
                self.local_counter = 0
                self.local_interval = min(self.local_step_clipper, 2 * self.local_interval)
        else:
            if t % self.var_interval == 0:
                self._variance_step(params, t)
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter, self.var_interval = 0, 2 * self.var_interval
            else:
                self._compressed_gradient_step(params, t)
            if t >= self.freeze_step:
                self._enter_local_steps(params)
        self.step_count = t
        return loss

    def _params(self) -> list[tuple[torch.Tensor, dict, dict]]:
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                state = self._state(p)
                state["step"] += 1
                out.append((p, group, state))
        return out

    def _denom(self, p: torch.Tensor, group: dict, state: dict) -> torch.Tensor:
        """``sqrt(v_hat) + eps`` (bias-corrected by the variance updates so far), inf where v = 0."""
        var_step = float(max(self.var_updates, 1))
        _, denom = self._step_size_and_denom(group, state, 1.0, var_step)
        if self._has_dead_elements(p, state):
            denom.masked_fill_(state["exp_avg_sq"] == 0, float("inf"))
        return denom

    def _step_size(self, group: dict, t: int) -> float:
        return group["lr"] / (1 - group["betas"][0] ** t) if group["bias_correction"] else group["lr"]

    def _decay(self, p: torch.Tensor, group: dict) -> None:
        if group["weight_decay"] != 0:
            p.mul_(1 - group["lr"] * group["weight_decay"])

    def _variance_step(self, params: list, t: int) -> None:
        """Adam on the full-precision averaged gradient; error buffers follow the new ``d``."""
        pending = self._pending_feedback.get("momentum")
        old = [self._denom(p, group, state) for p, group, state in params] if self._feedback or pending else None
        for p, group, state in params:
            beta1, beta2 = group["betas"]
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        self.var_updates += 1
        self._dead.clear()
        self._masks.clear()
        denoms = [self._denom(p, group, state) for p, group, state in params]
        if old is not None:
            ratios = [o.div_(n).nan_to_num_(nan=0.0, posinf=0.0) for o, n in zip(old, denoms)]
            self._rescale_feedback([state for _, _, state in params], ratios)
        for (p, group, state), denom in zip(params, denoms):
            self._decay(p, group)
            p.addcdiv_(state["exp_avg"], denom, value=-self._step_size(group, t))

    def _compressed_gradient_step(self, params: list, t: int) -> None:
        """The local gradient divided by ``d`` is averaged 1-bit; the momentum takes the average."""
        denoms = [self._denom(p, group, state) for p, group, state in params]
        scaled = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).float().div(d)
            for (p, _, _), d in zip(params, denoms)
        ]
        averaged = self._exchange_values([state for _, _, state in params], scaled, "gradient")
        for (p, group, state), denom, y in zip(params, denoms, averaged):
            # The averaged gradient is y * d (0 where v = 0: inf turned to 0 first, then back).
            denom.nan_to_num_(posinf=0.0)
            state["exp_avg"].mul_(group["betas"][0]).add_(y.mul_(denom), alpha=1 - group["betas"][0])
            denom.masked_fill_(denom == 0, float("inf"))
            self._decay(p, group)
            p.addcdiv_(state["exp_avg"], denom, value=-self._step_size(group, t))

    def _enter_local_steps(self, params: list) -> None:
        """Freeze the variance; local steps start from the current (identical) parameters."""
        self.frozen = True
        self._feedback.clear()  # the error buffers held gradient units; moves are next
        self._pending_feedback = {}
        for p, _, state in params:
            state["sync_params"] = p.detach().float().clone()
        self.lrs = [0.0] * len(self.param_groups)

    def _local_step(self, params: list, t: int) -> None:
        for p, group, state in params:
            if p.grad is not None:
                state["exp_avg"].lerp_(p.grad, 1 - group["betas"][0])
            else:
                state["exp_avg"].mul_(group["betas"][0])
            self._decay(p, group)
            p.addcdiv_(state["exp_avg"], self._denom(p, group, state), value=-self._step_size(group, t))
        for i, group in enumerate(self.param_groups):
            self.lrs[i] += self._step_size(group, t)
        if t % self.local_interval:
            return
        # Average the moves since the last synchronisation; everyone lands on the same point.
        moves = [p.detach().float() - state["sync_params"] for p, _, state in params]
        averaged = self._exchange_values([state for _, _, state in params], moves, "moves")
        group_index = {id(group): i for i, group in enumerate(self.param_groups)}
        for (p, group, state), delta in zip(params, averaged):
            p.copy_(state["sync_params"].add_(delta))
            # The momentum that moves a parameter by delta over these steps (DeepSpeed's estimate;
            # the weight decay of the steps is part of delta).
            lrs = self.lrs[group_index[id(group)]] or 1.0
            denom = self._denom(p, group, state).nan_to_num_(posinf=0.0)
            state["exp_avg"].copy_(delta).mul_(denom).div_(-lrs)
        self.lrs = [0.0] * len(self.param_groups)

    def _exchange_values(self, states: list[dict], values: list[torch.Tensor], prefix: str) -> list[torch.Tensor]:
        """Average ``values`` (fp32, one per state) over ranks, compressed in flat buckets with
        the error buffers ``prefix/<bucket>``; returns the averages."""
        transport = self._momentum_transport()
        if transport is None or transport.world_size == 1:
            return values
        host = self._stage_on_host(transport)
        out: list[torch.Tensor] = []
        first = 0
        for index, bucket in enumerate(self._buckets(states)):
            chunk = values[first : first + len(bucket)]
            first += len(bucket)
            flat = torch.cat([v.reshape(-1) for v in chunk])
            self._all_reduce_bucket(transport, f"{prefix}/{index}", flat, bucket, host)
            offset = 0
            for v in chunk:
                out.append(flat[offset : offset + v.numel()].view(v.shape))
                offset += v.numel()
        return out

    def _rescale_feedback(self, states: list[dict], ratios: list[torch.Tensor]) -> None:
        """Multiply the gradient error buffers elementwise by ``d_old / d_new``: they hold errors
        in units of ``g / d``."""
        transport = self._momentum_transport()
        if transport is None:
            return
        first = 0
        for index, bucket in enumerate(self._buckets(states)):
            ratio = torch.cat([r.reshape(-1) for r in ratios[first : first + len(bucket)]])
            first += len(bucket)
            key = f"gradient/{index}"
            if key not in self._feedback and key not in self._pending_feedback.get("momentum", {}):
                continue
            fb = self._feedback_for(key, ChunkLayout.for_all_reduce(ratio.numel(), transport.world_size), ratio.device)
            layout, rank = fb.layout, transport.rank
            fb.worker.view(-1)[: layout.numel].mul_(ratio)
            lo = rank * layout.chunk
            count = layout.counts[rank]
            fb.server[0, :count].mul_(ratio[lo : lo + count])

    # -- state ----------------------------------------------------------------------------------
    def onebit_state_dict(self) -> dict[str, Any]:
        out = super().onebit_state_dict()
        out["schedule"] = {
            "var_interval": self.var_interval, "var_counter": self.var_counter, "var_updates": self.var_updates,
            "local_interval": self.local_interval, "local_counter": self.local_counter, "lrs": list(self.lrs),
        }
        return out

    def load_onebit_state_dict(self, state: dict[str, Any]) -> None:
        schedule = state.get("schedule", {})
        self.var_interval = int(schedule.get("var_interval", 1))
        self.var_counter = int(schedule.get("var_counter", 0))
        self.var_updates = int(schedule.get("var_updates", 0))
        self.local_interval = int(schedule.get("local_interval", 1))
        self.local_counter = int(schedule.get("local_counter", 0))
        self.lrs = [float(x) for x in schedule.get("lrs", [0.0] * len(self.param_groups))]
        super().load_onebit_state_dict(state)


#: DeepSpeed's ``ZeroOneAdam`` parameter names (plus ``bucket_numel``).
ZERO_ONE_ADAM_PARAMS = (
    "lr", "betas", "eps", "weight_decay", "var_freeze_step", "var_update_scaler", "local_step_scaler",
    "local_step_clipper", "bias_correction", "eps_inside_sqrt", "amsgrad", "max_grad_norm", "cuda_aware",
    "comm_backend_name", "bucket_numel",
)


def make_zero_one_adam(param_groups: list[dict[str, Any]], comm: Communicator | None = None, **params: Any) -> ZeroOneAdam:
    """Factory of the ``zerooneadam`` optimizer record: checks the config's parameter names;
    ``comm`` is the engine's (the record needs a communicator)."""
    check_names("ZeroOneAdam", params, ZERO_ONE_ADAM_PARAMS)
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    return ZeroOneAdam(param_groups, comm=comm, **params)
