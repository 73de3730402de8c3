"""The composition fuzzer's fixed subset: sets of 3-5 features (tests/composition_fuzz_model.py) that
must equal their reference or be refused at initialize naming one of their refused pairs. The
named sets are the triples where defects were found; the drawn ones come from the model's
hypothesis strategy with a fixed seed. ``python tests/composition_fuzz.py --examples N`` runs more
and prints each failure as a minimal set."""
from __future__ import annotations

from pathlib import Path

import pytest

import composition_fuzz
import composition_fuzz_model as fuzz
from background import Command, call, returned

pytest.importorskip("zkit_offload")
pytest.importorskip("zkit_onebit")
pytest.importorskip("zkit_pipeline")
pytest.importorskip("hypothesis")

#: sets that failed once, kept whatever the draw
NAMED = [
    ("zero3", "partial_freeze", "zero_init"),
    ("zero2", "nvme_offload", "param_groups"),
    ("zero3", "nvme_offload", "param_groups"),
    ("grad_accum", "tensor_parallel", "lamb"),
    ("zero2", "act_ckpt", "save_mid_accum"),
    ("zero1", "grad_accum", "zero_init"),
    ("clipping", "scheduler", "zero_init"),
    ("grad_accum", "pipeline", "partial_freeze"),
    ("zero2", "tied_weights", "ds_import"),
    ("zero3", "tied_weights", "ds_import"),
    ("grad_accum", "tensor_parallel", "zero_init"),
    ("grad_accum", "pipeline", "zero_init"),
    ("zero3", "tensor_parallel", "zero_init"),
    ("zero3", "dcp_checkpoint", "scheduler"),  # loaded a DCP checkpoint and restarted the schedule
    ("grad_accum", "custom_comm", "tensor_parallel"),
    ("clipping", "pipeline", "tied_weights"),  # the pipeline's head was not tied to its embedding
    ("fp16", "grad_accum", "tied_weights"),  # one rounding-decided Adam step (fuzz.rounding_decided), no defect
    ("pipeline", "tied_weights", "zero_init"),  # the tied module's broadcast wrote past Init's placeholders
    ("act_ckpt", "pipeline", "partial_freeze"),  # the frozen stage has nothing to recompute: the other's trace
    ("nvme_offload", "onebit_adam", "client_sgd"),  # refused naming the ignored section's OneBitAdam, not SGD
    ("onebit_adam", "client_sgd", "dcp_checkpoint"),  # the client's SGD runs: nothing 1-bit to refuse at DCP
    ("nvme_offload", "clipping", "tensor_parallel"),  # the grid norm read gradients NVMe keeps: crashed at step 1
    ("zero1", "onebit_adam", "custom_comm"),  # refused at stages 1-2 (the model knew stage 0 only)
    ("zero2", "bf16", "grad_accum", "tied_weights"),  # bf16's rounding-decided Adam step, as fp16's
    ("onebit_comm", "reshard"),  # error feedback of stage 0's all-reduce met stage 1's reduce-scatter: crashed
    ("onebit_adam", "client_sgd", "onebit_comm"),  # the client's SGD compresses from step 1 (harness tolerance)
    ("nvme_offload", "onebit_adam", "client_sgd", "zero_init"),  # zero.Init refused the ignored section's optimizer
    ("overlap_gather", "offload_states", "zero2"),  # offload_states emptied buffers the gathers still wrote: SIGSEGV
    ("act_ckpt_plain", "compile", "tensor_parallel"),  # the regions and their collectives in the compiled graph
    ("zero2", "tensor_parallel", "comm_bf16"),  # one replica: the reference drops bf16 reductions, stage 2 rounds
    ("zero2", "grad_accum", "comm_bf16"),  # bf16 reductions crashed stages 2-3 at the first step (bf16 .grad)
    # stage 3 compiles each block inside the model's checkpoint: the FLOP probe's backward left the blocks
    # uncompiled for good; compiled, their recomputed backward wrote two gradients into one spare buffer
    ("zero3", "act_ckpt_plain", "compile"),
]
#: sets kept whatever the draw so that ZeRO-Offload overlapped is held to its twin, the same set with
#: cpu_offload, bit for bit (composition_fuzz.differs_from_twin), and where its bf16 micro-batches
#: are added in fp32 (composition.overlap_twin) to its reference's tolerance
OVERLAP = [
    ("zero3", "cpu_step_in_backward", "grad_accum", "param_groups"),
    ("cpu_step_in_backward", "pipeline", "save_load"),
    ("zero3", "cpu_step_in_backward", "bf16", "grad_accum"),
]
DRAWN_SEED, DRAWN = 0, 12
SETS = list(dict.fromkeys([*(fuzz.canonical(s) for s in [*NAMED, *OVERLAP]),
                           *composition_fuzz.draw(DRAWN, DRAWN_SEED)]))
RUN = [s for s in SETS if not ("ds_import" in s and composition_fuzz.deepspeed_missing())]


def _sets(root: Path) -> list[Command]:
    """Every set and its reference in one 2-rank process group."""
    return [call(root, "composition_fuzz:run", RUN, str(root))]


#: run beside the other tests from the session's start, in a process of its own (tests/background.py)
BACKGROUND = {"results": _sets}


@pytest.fixture(scope="module")
def results(background, request) -> dict:
    return returned(*background.wait(request))


def test_named_sets_are_drawable():
    for s in [*NAMED, *OVERLAP]:
        assert fuzz.drawable(fuzz.canonical(s)), s


def test_the_draw_is_fixed():
    assert composition_fuzz.draw(DRAWN, DRAWN_SEED) == composition_fuzz.draw(DRAWN, DRAWN_SEED)


@pytest.mark.parametrize("features", SETS, ids=lambda s: "x".join(s))
def test_set_equals_its_reference_or_is_refused(results, features):
    if "ds_import" in features and composition_fuzz.deepspeed_missing():
        pytest.skip(composition_fuzz.deepspeed_missing())
    why = composition_fuzz.verdict(features, results)
    assert why is None, f"{' x '.join(features)}: {why}"


def _params(value: float) -> dict:
    import torch

    return {"layers.0.weight": torch.full((2, 2), value)}


def test_verdict_names_what_went_wrong():
    """The judge itself, on made-up results: each way a set fails says how."""
    refused = ("zero3", "pipeline", "grad_accum")
    plain, ref = ("zero2", "grad_accum", "act_ckpt"), ()
    trained = {refused: {"params": _params(1.0), "missing": []}, ref: {"params": _params(1.0), "missing": []}}
    assert "must be refused at initialize" in composition_fuzz.verdict(refused, trained)
    wrong_words = {refused: {"refused": "ValueError: something else"}}
    assert "refused without naming any of [('zero3', 'pipeline')]" in composition_fuzz.verdict(refused, wrong_words)
    right_words = {refused: {"refused": "ValueError: ZeRO stage 3 cannot run under the pipeline"}}
    assert composition_fuzz.verdict(refused, right_words) is None
    assert "no pair of it is declared refused" in composition_fuzz.verdict(plain, {plain: {"refused": "E: no"}})
    assert "then crashed" in composition_fuzz.verdict(plain, {plain: {"crashed": "Traceback"}})
    no_trace = {plain: {"params": _params(1.0), "missing": ["act_ckpt: no block was recomputed"]}, ref: trained[ref]}
    assert "left no trace" in composition_fuzz.verdict(plain, no_trace)
    off = {plain: {"params": _params(1.1), "missing": []}, ref: trained[ref]}
    assert "differs from its reference ()" in composition_fuzz.verdict(plain, off)
    assert composition_fuzz.verdict(plain, {plain: {"params": _params(1.0), "missing": []}, ref: trained[ref]}) is None
    dcp, dcp_ref = ("zero1", "dcp_checkpoint", "scheduler"), ("scheduler",)
    loaded = {dcp: {"params": _params(1.0), "missing": []}, dcp_ref: {"params": _params(1.0), "missing": []}}
    assert "must be refused at the checkpoint" in composition_fuzz.verdict(dcp, loaded)
    assert "checkpoint refused without naming" in composition_fuzz.verdict(dcp, {dcp: {"refused_checkpoint": "E: no"}})
    said = "CheckpointError: a DCP checkpoint ... not the LR scheduler's state (load_lr_scheduler_states=False ...)"
    assert composition_fuzz.verdict(dcp, {dcp: {"refused_checkpoint": said}}) is None


def test_an_overlapped_offload_must_equal_its_twin_bit_for_bit():
    """ZeRO-Offload overlapped (cpu_step_in_backward) makes the step after backward's update
    exactly: a set of it that is within its reference's tolerance but one ulp from the same set with
    cpu_offload fails, naming that set; bf16 micro-batches added in fp32, and a reshard that loads
    the twin at another stage, have no twin to equal."""
    overlapped, twin, ref = ("zero2", "cpu_step_in_backward", "grad_accum"), ("zero2", "cpu_offload", "grad_accum"), ()
    assert fuzz.overlap_twin(overlapped) == twin
    assert fuzz.overlap_twin(("zero3", "cpu_step_in_backward", "bf16", "grad_accum")) is None
    assert fuzz.overlap_twin(("cpu_step_in_backward", "bf16")) == ("cpu_offload", "bf16")
    assert fuzz.overlap_twin(("cpu_offload", "grad_accum")) is None
    # from stage 2 the overlap reshards to 3 and its twin to 1; from 3 both to 2
    assert fuzz.overlap_twin(("cpu_step_in_backward", "onebit_comm", "reshard")) is None
    assert fuzz.overlap_twin(("zero3", "cpu_step_in_backward", "reshard")) == ("zero3", "cpu_offload", "reshard")

    def judged(mine: float, theirs: dict) -> str | None:
        return composition_fuzz.verdict(overlapped, {overlapped: {"params": _params(mine), "missing": []},
                                                     ref: {"params": _params(1.0), "missing": []}, twin: theirs})

    assert judged(1.0, {"params": _params(1.0), "missing": []}) is None
    assert judged(1.0000001, {"params": _params(1.0), "missing": []}) == (
        "differs from the same set with cpu_offload ('zero2', 'cpu_offload', 'grad_accum'), the step after backward "
        "it must equal bit for bit: layers.0.weight by 1.19e-07")
    assert judged(1.0, {"refused": "ValueError: no"}).startswith(
        "the same set with cpu_offload ('zero2', 'cpu_offload', 'grad_accum') did not train: {'refused'")


def test_evidence_of_the_overlapped_offload():
    """cpu_step_in_backward's trace: zkit-offload's overlapped host store, and units stepped during
    backward in every engine of the run."""
    from types import SimpleNamespace

    from composition_evidence import _stepped_in_backward
    from zkit_offload.host_master import HostMasterStore

    def engine(store):
        return SimpleNamespace(partitioner=SimpleNamespace(master_store=store))

    assert _stepped_in_backward(engine(SimpleNamespace()), {"host_steps": [{"units": 3}]}) == (
        "the master store is SimpleNamespace, not zkit-offload's overlapped host store")
    overlapped = engine(HostMasterStore.__new__(HostMasterStore))  # a type to check: no buffers needed
    assert _stepped_in_backward(overlapped, {"host_steps": [{"units": 3}, {"units": 1}]}) is None
    assert _stepped_in_backward(overlapped, {"host_steps": [{"units": 3}, {"units": 0}]}) == (
        "units stepped in backward per engine: [{'units': 3}, {'units': 0}]")


def test_a_few_rounding_decided_elements_pass_in_fp16_sets_that_reorder_sums():
    """fp16 accumulated (or otherwise reordered) under Adam: up to 1% of the elements may be a few
    Adam steps off (composition_fuzz_model.rounding_decided); more of them, a larger gap, another
    optimizer or an unchanged order fail as before."""
    import torch

    def params(moved: int, by: float) -> dict:
        w = torch.ones(1000)
        w[:moved] += by
        return {"layers.0.weight": w}

    accum, ref = ("fp16", "grad_accum", "tied_weights"), ("fp16", "tied_weights")

    def judged(features, moved, by, reference=ref):
        return composition_fuzz.verdict(features, {features: {"params": params(moved, by), "missing": []},
                                                   reference: {"params": params(0, 0.0), "missing": []}})

    assert judged(accum, 1, 0.0095) is None  # what fp16 x grad_accum x tied_weights showed
    assert judged(accum, 10, 0.02) is None
    assert judged(accum, 11, 0.0095).endswith(
        "11 elements beyond it (at most 10 may be rounding-decided), the largest layers.0.weight by 0.0095 "
        "(at most 0.0606)")
    assert "the largest layers.0.weight by 0.1 (at most 0.0606)" in judged(accum, 1, 0.1)
    assert judged(("zero1", "fp16", "tied_weights"), 1, 0.0095).endswith("by 0.0095 (tolerance 0.002)")
    lamb = ("fp16", "grad_accum", "lamb")
    assert judged(lamb, 1, 0.0095, reference=("fp16", "lamb")).endswith("by 0.0095 (tolerance 0.002)")
    assert judged(accum, 1, float("nan")) == "parameter layers.0.weight is not finite"


def test_a_pair_refused_at_one_stage_is_refused_at_that_stage_only():
    """pipeline x tied_weights is refused at ZeRO stage 2, given or an offload's default, and
    must equal its reference at the other stages."""
    said = ("ValueError: PipelineRunner: ZeRO stage 2 with a TiedLayerSpec shared by several pipeline stages is not "
            "supported")
    for at_two in (("zero2", "pipeline", "tied_weights"), ("cpu_offload", "pipeline", "tied_weights")):
        assert fuzz.refused_pairs(at_two) == [("pipeline", "tied_weights")], at_two
        assert "must be refused at initialize" in composition_fuzz.verdict(
            at_two, {at_two: {"params": _params(1.0), "missing": []}})
        assert composition_fuzz.verdict(at_two, {at_two: {"refused": said}}) is None
    for elsewhere in (("pipeline", "tied_weights"), ("zero1", "cpu_offload", "pipeline", "tied_weights")):
        assert fuzz.refused_pairs(elsewhere) == [], elsewhere
    # resharding from stage 1 loads at stage 2: the loading engine's initialize refuses it
    to_two = ("zero1", "pipeline", "tied_weights", "reshard")
    assert fuzz.refused_pairs(to_two) == [] and fuzz.refused_checkpoint_pairs(to_two) == [("pipeline", "tied_weights")]
    assert composition_fuzz.verdict(to_two, {to_two: {"refused_checkpoint": said}}) is None
    assert fuzz.refused_checkpoint_pairs(("pipeline", "tied_weights", "reshard")) == []  # 0 -> 1


def test_evidence_reports_a_feature_that_did_not_run():
    """The traces composition_evidence.py reads, absent: each feature is reported, saying what is missing
    (the matrix's onebit_comm cells sent nothing compressed before their threshold was lowered)."""
    from types import SimpleNamespace

    import torch
    from composition_evidence import missing

    unit = SimpleNamespace(numel=8, shard=8)
    engine = SimpleNamespace(
        comm_stats=lambda: {"all_reduce": {"calls": 26, "bytes": 10408}},
        partitioner=SimpleNamespace(stage=2, world=2, units=[unit]),
        allocator=SimpleNamespace(stats=lambda: {}),
        gradient_accumulation_steps=lambda: 1,
        comm=None,
    )
    run = {"compresses": True, "recompute": SimpleNamespace(recomputes=0), "accum_base": 1,
           "comm_built": lambda: [None], "replicas": 2, "dcp_format": "zkit"}
    got = missing(("onebit_comm", "zero2", "act_ckpt", "grad_accum", "custom_comm", "dcp_checkpoint"), engine,
                  torch.nn.Linear(1, 1), run)
    assert got == [
        "onebit_comm: nothing was sent 1-bit compressed: {'all_reduce': {'calls': 26, 'bytes': 10408}}",
        "zero2: stage 2 over 2 replicas keeps every element on this rank",
        "act_ckpt: no block was recomputed in backward",
        "grad_accum: 1 micro-batches per step",
        "custom_comm: the engine reduces through None",
        "dcp_checkpoint: the saved directory loads as 'zkit', not DCP",
    ]


def test_counting_communicator_evidence():
    """custom_comm's trace: the gradients reduced through it, and the grid's groups built by it."""
    from types import SimpleNamespace

    from collections import Counter

    from composition_comm import CountingCommunicator, reduced_through

    comm = CountingCommunicator.__new__(CountingCommunicator)  # no process group needed to read counts
    comm.calls = Counter()
    engine = SimpleNamespace(comm=comm)
    assert "no gradient was reduced" in reduced_through(engine, [None], 2, False)
    assert reduced_through(engine, [None], 1, False) is None  # one replica: nothing to reduce
    assert "the grid's groups came from elsewhere" in reduced_through(engine, [None], 1, True)
    comm.calls["reduce_scatter"] += 1
    assert reduced_through(engine, [None, "pipe"], 2, True) is None
