"""``engine.offload_states()`` right after a step with ``overlap_param_gather``: the step's
parameter all-gathers are still writing into the parameters' buffers, so offloading waits for
them before it empties those storages (emptying them under a gather in flight had the transport
write into freed memory), and training goes on bit for bit as without the round trips."""
from __future__ import annotations

import torch

from zkit.testing import run_ranks

import offload_states_overlap_ranks as ranks


def test_offload_waits_for_the_parameter_gathers_in_flight():
    for rank, both in enumerate(run_ranks(ranks.with_and_without, 2, timeout=300)):
        moved, plain = both["moved"], both["plain"]
        assert all(n > 0 for n in moved["in_flight"]), (rank, moved["in_flight"])  # the gathers were in flight
        assert moved["left"] == [0, 0, 0], (rank, moved["left"])
        assert moved["losses"] == plain["losses"], rank
        assert all(torch.equal(a, b) for a, b in zip(moved["params"], plain["params"])), rank
