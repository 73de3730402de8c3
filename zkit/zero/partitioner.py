"""What stages 0, 1 and 2 share: flat parameter buffers, the fp32 master shard, the optimizer over
that shard, the step and the parameter refresh. The stages differ only in how gradients are held
and reduced (``stage0.py``, ``stage1.py``, ``stage2.py``).

Layout: trainable parameters, in reverse registration order (the order backward produces their
gradients), are packed into units of ``reduce_bucket_size`` elements (:mod:`zkit.zero.flat`). Each
parameter's ``.data`` becomes a view into its unit's flat buffer. Rank ``r`` owns shard ``r`` of every
unit: the fp32 master copy and the optimizer state of those elements. Stage 0 owns everything
(``shards_states = False``).
"""
from __future__ import annotations

from typing import Any

import torch

from zkit.partition import PartitionContext, Partitioner, Piece
from zkit.zero.flat import plan_units

_COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class ZeroPartitioner(Partitioner):
    """Base of the data-parallel stages. Subclasses implement the gradient path:
    ``_init_grads``, ``_on_grad_ready``, ``backward_context``, ``after_backward``, ``_grad_shards``
    and ``zero_grad``."""

    shards_states = True

    def __init__(self, ctx: PartitionContext) -> None:
        super().__init__(ctx)
        zc = ctx.config.zero_optimization
        self.dtype = ctx.dtype
        comm_type = getattr(ctx.config, "communication_data_type", None)
        self.comm_dtype = _COMM_DTYPES[comm_type] if comm_type else ctx.dtype
        self.rank = self.comm.rank if self.shards_states else 0
        self.world = self.comm.world_size if self.shards_states else 1
        #: plugins (1-bit optimizers) may switch gradient reduction off.
        self.gradient_reduction = True

        named = list(self.named_trainable())
        if not named:
            raise ValueError("the model has no trainable parameters (requires_grad=True): nothing to train")
        self.param_of = dict(named)
        self.units = plan_units(
            ((n, p.shape) for n, p in reversed(named)), max(int(zc.reduce_bucket_size), 1), self.world
        )
        self.unit_params = [[self.param_of[s.name] for s in u.slots] for u in self.units]
        self.unit_of = {id(p): u.index for u in self.units for p in self.unit_params[u.index]}
        self._build_param_buffers()
        self._build_master()
        self.optimizer = self._build_optimizer()
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for _, p in named
        ]
        self._init_grads()

    # -- construction ----------------------------------------------------------------------------
    def _build_param_buffers(self) -> None:
        self.param_bufs: list[torch.Tensor] = []
        for u, params in zip(self.units, self.unit_params):
            buf = self.allocator.zeros(u.padded, self.dtype, "param")
            for slot, p in zip(u.slots, params):
                view = buf[slot.offset : slot.offset + slot.numel].view(slot.shape)
                view.copy_(p.data)
                p.data = view
            self.param_bufs.append(buf)

    def _build_master(self) -> None:
        place = self.allocator.place("master")
        # fp32 training with the master on the training device: the parameters *are* the master.
        self.master_is_param = self.dtype == torch.float32 and place == self.ctx.device
        self.master: list[torch.Tensor] = []
        if self.master_is_param:
            for u, buf in zip(self.units, self.param_bufs):
                lo, hi = u.shard_range(self.rank)
                self.master.append(buf[lo:hi])
            return
        flat = self.allocator.empty(sum(u.shard for u in self.units), torch.float32, "master")
        start = 0
        for u, buf in zip(self.units, self.param_bufs):
            lo, hi = u.shard_range(self.rank)
            m = flat[start : start + u.shard]
            m.copy_(buf[lo:hi])
            self.master.append(m)
            start += u.shard

    def _build_optimizer(self) -> torch.optim.Optimizer:
        rec = self.ctx.optimizer
        if self.shards_states and self.world > 1 and not rec.elementwise:
            raise ValueError(
                f"optimizer {rec.name!r} is not elementwise (it needs whole-parameter norms), so it "
                f"cannot step on ZeRO stage {self.stage} shards; use stage 0 or an elementwise optimizer"
            )
        group_of = {}
        for gi, group in enumerate(self.ctx.param_groups):
            for p in group["params"]:
                group_of[id(p)] = gi
        groups: list[dict[str, Any]] = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in self.ctx.param_groups
        ]
        #: (optimizer param, unit, start in shard, end in shard, piece) for every owned piece.
        self.owned: list[tuple[torch.nn.Parameter, int, int, int, Any]] = []
        for u in self.units:
            for piece in u.pieces(self.rank):
                a = piece.shard_offset
                opt_param = torch.nn.Parameter(self.master[u.index][a : a + piece.numel], requires_grad=True)
                gi = group_of.get(id(self.param_of[piece.slot.name]), 0)
                groups[gi]["params"].append(opt_param)
                self.owned.append((opt_param, u.index, a, a + piece.numel, piece))
        if not self.owned:
            # A rank owning nothing still needs an optimizer (schedules and checkpoints see it).
            groups[0]["params"].append(torch.nn.Parameter(torch.zeros(0, device=self.master_device)))
        return rec.factory(groups, **self.ctx.optimizer_params)

    @property
    def master_device(self) -> torch.device:
        return self.master[0].device if self.master else self.ctx.device

    # -- stage-specific gradient path ------------------------------------------------------------
    def _init_grads(self) -> None:
        raise NotImplementedError

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        raise NotImplementedError

    def _grad_shards(self) -> list[torch.Tensor]:
        """Per unit, the reduced gradient of this rank's shard (model or communication dtype)."""
        raise NotImplementedError

    # -- step ------------------------------------------------------------------------------------
    def grad_norm(self) -> torch.Tensor:
        sq = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        for g in self._grad_shards():
            sq += torch.linalg.vector_norm(g, dtype=torch.float32).to(sq.device) ** 2
        if self.shards_states and self.world > 1:
            self.comm.all_reduce(sq, "sum")
        return sq.sqrt()

    def _master_grads(self) -> list[torch.Tensor]:
        shards = self._grad_shards()
        if self.master_is_param:
            return shards
        return [g.to(device=self.master_device, dtype=torch.float32) for g in shards]

    def step(self, grad_factor: float) -> None:
        grads = self._master_grads()
        if grad_factor != 1.0:
            for g in grads:
                g.mul_(grad_factor)
        for opt_param, u, a, b, _ in self.owned:
            opt_param.grad = grads[u][a:b]
        self.optimizer.step()
        for opt_param, *_ in self.owned:
            opt_param.grad = None
        self.publish_params()

    def publish_params(self) -> None:
        """Copy the updated master shard into the model's parameters (and to the other ranks)."""
        handles = []
        for u, buf, m in zip(self.units, self.param_bufs, self.master):
            lo, hi = u.shard_range(self.rank)
            if not self.master_is_param:
                buf[lo:hi].copy_(m)
            if self.shards_states and self.world > 1:
                handles.append(self.comm.all_gather(buf, buf[lo:hi].clone(), async_op=True))
        for h in handles:
            h.wait()

    def after_load(self) -> None:
        self.publish_params()

    # -- state -----------------------------------------------------------------------------------
    def pieces(self) -> list[Piece]:
        return [
            Piece(
                name=piece.slot.name,
                shape=piece.slot.shape,
                start=piece.param_start,
                end=piece.param_end,
                master=opt_param.data,
                opt_param=opt_param,
            )
            for opt_param, _, _, _, piece in self.owned
        ]

    def writes_checkpoint(self) -> bool:
        return self.shards_states or self.comm.rank == 0

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
