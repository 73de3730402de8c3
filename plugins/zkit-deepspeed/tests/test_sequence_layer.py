"""``deepspeed.sequence.layer.DistributedAttention`` on zkit-sequence: each rank's slice of the
output and of the inputs' gradients equal attention over the whole sequence, in both of DeepSpeed's
layouts and with fewer key-value heads; what zkit does not provide is refused with a message."""
from __future__ import annotations

import pytest
import torch

import sequence_layer_ranks as slr
from zkit.testing import run_ranks

pytest.importorskip("zkit_sequence")


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_distributed_attention_equals_whole_sequence_attention(layout, kv_heads):
    results = run_ranks(slr.distributed_attention, 2, args=(layout, kv_heads), timeout=120)
    for r in results:
        assert r["out"] < 1e-6 and r["grads"] < 1e-6, r
        assert r["shape"] == ((2, 8, 4, 8) if layout == 0 else (8, 2, 4, 8))
        assert r["bytes"] > 0  # counted by zkit's communicator


def test_what_zkit_does_not_provide_is_refused():
    from deepspeed.refused import FeatureNotProvided
    from deepspeed.sequence.layer import DistributedAttention

    with pytest.raises(ValueError, match="scatter_idx=1"):
        DistributedAttention(torch.nn.Identity(), None, scatter_idx=1)
    with pytest.raises(FeatureNotProvided, match="sp_stream"):
        DistributedAttention(torch.nn.Identity(), None, sp_stream=object())
    with pytest.raises(FeatureNotProvided, match="FPDT"):
        import deepspeed.sequence.fpdt_layer  # noqa: F401


def test_groups_answer_the_engines_sequence_group():
    results = run_ranks(slr.groups_after_initialize, 2, timeout=120)
    for rank, r in enumerate(results):
        assert r == {"size": 2, "rank": rank, "same": True, "train_batch": 1, "seq_dp": 2}, r


def test_the_data_loader_adapter_gives_deepspeeds_slices():
    results = run_ranks(slr.adapter_batches, 2, timeout=120)
    # DeepSpeed's expected_batch_b: rank 0's batch, sliced, then rank 1's (the same sample here)
    expected = [{"input_ids": [[1, 10, 10]], "position_ids": [[0, 1, 2]], "shift_labels": [[10, 10, 10]]},
                {"input_ids": [[10, 2, 2]], "position_ids": [[3, 4, 5]], "shift_labels": [[2, 2, -100]]}]
    for rank, batches in enumerate(results):
        assert batches == [expected[rank], expected[rank]], (rank, batches)


def test_the_adapter_refuses_a_batch_without_position_ids():
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    adapter = ulysses_sp.UlyssesSPDataLoaderAdapter([{"input_ids": torch.zeros(1, 4)}], 0, None, 2, "cpu")
    with pytest.raises(ValueError, match="Ulysses SP requires `position_ids`"):
        next(adapter)
