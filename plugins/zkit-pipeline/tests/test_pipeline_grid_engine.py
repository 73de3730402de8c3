"""Pipeline checkpoints (per-stage parts, resumed exactly, resharded over the data axis),
``engine.eval_batch``, and the small GPT on 4 ranks as 2 pipe x 2 data and 2 tensor x 2 data
through ``zkit.initialize``, against dense single-process training."""
from __future__ import annotations

import os

import pytest

import pp_grid_ranks as pgr
from zkit.testing import run_ranks


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline-ckpt")
    return str(root / "two"), str(root / "four")


@pytest.fixture(scope="module")
def two_ranks(paths):
    return run_ranks(pgr.two_ranks, 2, args=(paths[0],), timeout=240)


@pytest.fixture(scope="module")
def four_ranks(paths, two_ranks):  # loads the checkpoint the 2-rank job wrote
    return run_ranks(pgr.four_ranks, 4, args=paths, timeout=300)


def test_each_stage_writes_its_own_part(two_ranks, paths):
    tag = os.path.join(paths[0], "mid")
    assert sorted(os.listdir(tag)) == ["meta.msgpack", "pipe00", "pipe01"]
    for part in ("pipe00", "pipe01"):
        assert sorted(os.listdir(os.path.join(tag, part))) == ["meta.msgpack", "rank_00000.pt"]
    assert open(os.path.join(paths[0], "latest")).read() == "mid"


@pytest.mark.parametrize("job", ["two", "four"])
def test_resumed_training_continues_identically(two_ranks, four_ranks, job):
    for rank, r in enumerate(two_ranks if job == "two" else four_ranks):
        assert r["ckpt"]["resumed"] == r["ckpt"]["after"], f"rank {rank}"
        assert r["ckpt"]["global_steps"] == 4


def test_two_by_one_checkpoint_loads_at_two_data_parallel_replicas(two_ranks, four_ranks):
    expected = two_ranks[0]["ckpt"]["after"][0]
    replica_zero = [r for r in four_ranks if r["replica"] == 0]
    assert len(replica_zero) == 2
    for r in replica_zero:
        assert r["resharded_first_loss"] == pytest.approx(expected, rel=1e-6)


def test_other_stage_count_and_unsplit_models_are_refused(two_ranks):
    for r in two_ranks:
        assert "pipe: checkpoint 2, model 1" in r["stage_count_error"]
        assert "loading across pipeline stage counts (2 -> 1) is not supported" in r["stage_count_error"]
        assert "split into 2 model-parallel parts (pipe00, pipe01); this model is not split" in r["unsplit_error"]
    assert "consolidate one part's directory" in two_ranks[0]["consolidate_error"]


def test_eval_batch_is_the_forward_loss_and_changes_nothing(two_ranks):
    for r in two_ranks:
        e = r["eval"]
        assert e["eval"] == e["again"] == pytest.approx(e["train"], rel=1e-6)
        assert e["steps_after_eval"] == 0


@pytest.mark.parametrize("layout", ["pipe", "tensor"])
def test_gpt_on_four_ranks_matches_dense_training(four_ranks, layout):
    for rank, r in enumerate(four_ranks):
        assert r[layout] == pytest.approx(r[f"dense_{layout}"], rel=2e-4), f"rank {rank}"


@pytest.mark.parametrize("layout", ["pipe", "tensor"])
def test_clipping_norm_covers_the_grid_once(four_ranks, layout):
    """Replicated tensor-parallel parameters and the tied embedding counted once: the engine's
    global norm is the dense model's."""
    for r in four_ranks:
        assert r["dense_norms"][0] > pgr.GPT_CLIP  # clipping is active
        assert r[f"{layout}_norms"] == pytest.approx(r["dense_norms"], rel=2e-4)


def test_tensor_parallel_checkpoint_resumes(four_ranks):
    for r in four_ranks:
        assert r["tp_resumed"] == r["tp_after"]


# -- errors that need no ranks ----------------------------------------------------------------------

def test_tensor_parallel_module_needs_torch_distributed():
    from zkit_pipeline import TensorParallelModule

    with pytest.raises(ValueError, match="TensorParallelModule needs torch.distributed to be initialised"):
        TensorParallelModule(lambda tp: None, tensor=2)


def test_split_checkpoint_layout_mismatch_names_the_difference(tmp_path):
    from zkit.checkpoint import CheckpointError
    from zkit.checkpoint.parts import check_layout, refuse_mismatch
    from zkit.core.model_parts import model_part

    saved = {"pipe": 2, "tensor": 1, "layer_bounds": [0, 3, 6]}
    check_layout(tmp_path, saved, {"pipe": 2, "tensor": 1, "layer_bounds": (0, 3, 6)})  # tuples == lists
    with pytest.raises(CheckpointError, match=r"layer_bounds: checkpoint \[0, 3, 6\], model \[0, 2, 6\]"):
        check_layout(tmp_path, saved, {"pipe": 2, "tensor": 1, "layer_bounds": [0, 2, 6]})
    with pytest.raises(CheckpointError, match="the checkpoint holds an unsplit model; this model is split"):
        refuse_mismatch(tmp_path, None, ("pipe00", saved))

    class Bad:
        model_parallel_part = ("../x", {})

    with pytest.raises(CheckpointError, match="model_parallel_part name '../x' must be a plain directory name"):
        model_part(Bad())


def test_grid_norm_refuses_a_partitioner_without_gradient_pieces():
    import torch

    from zkit_pipeline.grid_norm import GridNorm, replication_weights

    p = torch.nn.Parameter(torch.ones(2))

    class Opaque:
        def named_trainable(self):
            yield "w", p

        def grad_norm(self):
            return torch.tensor(1.0)

    weights = replication_weights(torch.nn.ParameterList([p]), tensor_degree=2, tied_copies={})
    assert weights == {id(p): 0.5}
    with pytest.raises(ValueError, match="needs a ZeRO stage 0-2 partitioner"):
        GridNorm(Opaque(), weights, None)


def test_eval_batch_refuses_a_model_that_is_not_a_pipeline():
    from zkit_pipeline import eval_batch

    class Engine:
        module = object()

    with pytest.raises(TypeError, match="eval_batch runs a PipelineModule through its stages; this engine's model is a object"):
        eval_batch(Engine(), iter([]))
