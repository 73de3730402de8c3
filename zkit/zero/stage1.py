"""Stage 1: optimizer states partitioned. Gradients accumulate in full buffers; at the last
micro-step each unit is reduce-scattered, so rank r receives the averaged gradient of the shard it
owns, steps its fp32 master and optimizer state for that shard alone, and the updated shards are
all-gathered back into every rank's parameters. Per-rank model states: 2Ψ + 2Ψ + 12Ψ/N."""
from __future__ import annotations

import torch

from zkit.zero.full_grads import FullGradientPartitioner


class Stage1(FullGradientPartitioner):
    stage = 1

    def _init_grads(self) -> None:
        super()._init_grads()
        self.grad_shards = [self.allocator.zeros(u.shard, self.comm_dtype, "grad") for u in self.units]

    def _launch(self, unit: int):
        return self.comm.reduce_scatter(
            self.grad_shards[unit], self._comm_buffer(unit), "avg", async_op=True
        )

    def _copy_back(self, unit: int, scratch: torch.Tensor) -> None:
        pass  # the reduced result lives in grad_shards; the scratch input is just dropped

    def after_backward(self, boundary: bool) -> None:
        if boundary and self.comm.world_size == 1 and self.gradient_reduction:
            for shard, buf in zip(self.grad_shards, self.grad_bufs):
                shard.copy_(buf)  # one rank: the "reduced" shard is the whole local gradient
        super().after_backward(boundary)

    def _grad_shards(self):
        if not self.gradient_reduction:
            raise RuntimeError("ZeRO stage 1 needs its gradient reduce-scatter; it cannot be switched off")
        return self.grad_shards

    def zero_grad(self) -> None:
        super().zero_grad()
        for shard in self.grad_shards:
            shard.zero_()
