"""Stage 0: plain data parallelism. Every rank holds all model states; each gradient unit is
all-reduced (averaged) as soon as it is ready, overlapping the rest of backward."""
from __future__ import annotations

import torch

from zkit.zero.full_grads import FullGradientPartitioner


class Stage0(FullGradientPartitioner):
    stage = 0
    shards_states = False

    def _launch(self, unit: int):
        return self.comm.all_reduce(self._comm_buffer(unit), self.reduce_op, async_op=True, key=self.unit_key(unit))

    def _reduced(self, unit: int, buf: torch.Tensor) -> torch.Tensor:
        return buf

    def reduced_grad_shards(self):
        return self._final_grad_bufs()
