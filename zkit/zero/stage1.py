"""Stage 1: optimizer states partitioned. Gradients accumulate in full buffers; at the last
micro-step each unit is reduce-scattered in place, so rank r's own slice of the unit's gradient
buffer receives the averaged gradient of the shard it owns; it steps its fp32 master and optimizer
state for that shard alone, and the updated shards are all-gathered back into every rank's
parameters. Per-rank model states: 2Ψ + 2Ψ + 12Ψ/N.

After the reduction only the rank's own slice of a gradient buffer is meaningful (the rest is
the collective's scratch, see :meth:`zkit.core.communicator.Communicator.reduce_scatter`), as with DeepSpeed,
whose stage-1 parameters carry no full gradient after backward either."""
from __future__ import annotations

import torch

from zkit.zero.full_grads import FullGradientPartitioner


class Stage1(FullGradientPartitioner):
    stage = 1

    def _init_grads(self) -> None:
        self._own_slices: list[torch.Tensor] = []
        self._own_slices_of: list[torch.Tensor] | None = None
        super()._init_grads()

    def _own_slice(self, unit: int) -> torch.Tensor:
        """This rank's slice of the unit's gradient buffer: the same tensor every step, as the
        buffer is (so the step's views of it are made once)."""
        bufs = self._ensure_grad_bufs()
        if self._own_slices_of is not bufs:  # the buffers were made (again)
            self._own_slices = [buf[slice(*u.shard_range(self.rank))] for u, buf in zip(self.units, bufs)]
            self._own_slices_of = bufs
        return self._own_slices[unit]

    def _launch(self, unit: int):
        src = self._comm_buffer(unit)
        lo, hi = self.units[unit].shard_range(self.rank)
        # In place: the output is this rank's own chunk of the input (gloo and NCCL allow it).
        return self.comm.reduce_scatter(src[lo:hi], src, self.reduce_op, async_op=True, key=self.unit_key(unit))

    def _reduced(self, unit: int, buf: torch.Tensor) -> torch.Tensor:
        lo, hi = self.units[unit].shard_range(self.rank)
        return buf[lo:hi]

    def _copy_back(self, unit: int, scratch: torch.Tensor) -> None:
        lo, hi = self.units[unit].shard_range(self.rank)
        self._own_slice(unit).copy_(scratch[lo:hi])

    def reduced_grad_shards(self):
        if not self.gradient_reduction and self.comm.world_size > 1:
            raise RuntimeError("ZeRO stage 1 needs its gradient reduce-scatter; it cannot be switched off")
        self._final_grad_bufs()
        return [self._own_slice(u.index) for u in self.units]
