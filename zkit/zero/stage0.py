"""Stage 0: plain data parallelism. Every rank holds all model states; each gradient unit is
all-reduced (averaged) as soon as it is ready, overlapping the rest of backward."""
from __future__ import annotations

from zkit.zero.full_grads import FullGradientPartitioner


class Stage0(FullGradientPartitioner):
    stage = 0
    shards_states = False

    def _launch(self, unit: int):
        return self.comm.all_reduce(self._comm_buffer(unit), "avg", async_op=True)

    def _grad_shards(self):
        return self.grad_bufs
