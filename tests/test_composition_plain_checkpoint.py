"""The matrix's act_ckpt_plain feature: its trace (composition_evidence._plain_checkpoint) tells the
plain checkpoint path from the eager one, and the harness's recompute counter leaves a compiled
forward whole, so that a compiled cell's checkpointed regions can be traced into its graph."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import composition as matrix
from composition_evidence import RecomputeCounter, RegionCountingBackend, missing
from composition_models import Net, batch, loss
from zkit.activations import recompute


@pytest.fixture(autouse=True)
def _defaults():
    recompute.reset()
    yield
    recompute.reset()


def _missing(run: dict) -> list[str]:
    return missing(("act_ckpt_plain",), None, torch.nn.Linear(1, 1), run)


def test_the_section_has_every_option_off():
    settings = recompute.configure(matrix.config(("act_ckpt_plain",), ""))
    assert not (settings.profile or settings.cpu_checkpointing or settings.partition_activations
                or settings.synchronize_checkpoint_boundary or settings.contiguous_memory_optimization)


def test_evidence_names_the_eager_path_and_the_missing_recomputes():
    recompute.configure(checkpoint_in_cpu=True)
    ran = {"recompute": SimpleNamespace(recomputes=4)}
    assert _missing(ran) == ["act_ckpt_plain: the regions ran on the eager path because of "
                             "['activation_checkpointing.cpu_checkpointing']"]
    recompute.reset()
    assert _missing(ran) == []
    assert _missing({"recompute": SimpleNamespace(recomputes=0)}) == [
        "act_ckpt_plain: no block was recomputed in backward"]
    eager_regions = RegionCountingBackend()  # compiled graphs without a checkpointed region in them
    assert _missing({"recompute": SimpleNamespace(recomputes=4), "backends": [eager_regions]}) == [
        "act_ckpt_plain: no checkpointed region was traced into a compiled graph"]
    traced = RegionCountingBackend()
    traced.regions = 2  # a compiled backward recomputes them: no forward hook runs in backward
    assert _missing({"recompute": SimpleNamespace(recomputes=0), "backends": [traced]}) == []
    # stage 3 compiles each block, inside the model's checkpoint: its recomputations run compiled
    regional = {"backends": [eager_regions], "regional": True, "recompute": SimpleNamespace(recomputes=4)}
    assert _missing(regional) == [
        "act_ckpt_plain: no compiled block forward ran as a checkpoint's recomputation in backward"]
    recomputed = RegionCountingBackend()
    recomputed.recomputed = 4
    assert _missing({**regional, "backends": [recomputed]}) == []
    # block_sparse's kernel or tensor_parallel's collectives: Dynamo runs the whole region eagerly
    untraceable = {"backends": [eager_regions], "untraceable_blocks": True}
    assert _missing({**untraceable, "recompute": SimpleNamespace(recomputes=4)}) == []
    assert _missing({**untraceable, "recompute": SimpleNamespace(recomputes=0)}) == [
        "act_ckpt_plain: no block was recomputed in backward"]


def test_a_seeded_tensor_parallel_tracker_is_reported_as_the_eager_path():
    pytest.importorskip("zkit_pipeline")
    from zkit_pipeline.tensor_parallel import get_rng_tracker, model_parallel_seed

    state = torch.get_rng_state()
    model_parallel_seed(0, tensor_rank=0)
    try:
        got = _missing({"recompute": SimpleNamespace(recomputes=4)})
    finally:
        get_rng_tracker().reset()  # left seeded, every later region of this process would run eagerly
        torch.set_rng_state(state)
    assert got == ["act_ckpt_plain: the regions ran on the eager path because of "
                   "['the replay of a seeded RNG tracker (tensor-parallel dropout)']"]


def test_recompute_counter_leaves_the_compiled_forward_whole():
    """With the counter's hooks on every module (as in every matrix cell), a compiled forward of
    checkpointed blocks is one graph holding both regions; the counter still counts eager recomputes."""
    import torch._dynamo as dynamo

    features = ("act_ckpt_plain",)
    x, y = batch(0, features)
    net = Net(features)
    counter = RecomputeCounter(net)
    loss(net(x), y).backward()
    assert counter.recomputes > 0  # (torch stops a recompute once backward has what it needs)
    dynamo.reset()
    backend = RegionCountingBackend()
    compiled = torch.compile(net, backend=backend)
    for _ in range(2):
        loss(compiled(x), y).backward()
    dynamo.reset()
    assert (backend.graphs, backend.regions) == (1, 2)
