"""The feature model of the composition fuzzer (tests/composition_fuzz.py): the matrix's features
(tests/composition.py) plus the ones below, what each does, which run is its reference, and which
sets are refused at initialize, not drawn, or implied.

A drawn set either **equals its reference** (the same run keeping only its numerics and model
features, at ZeRO stage 0 on 2 ranks, without offload, accumulation, checkpointing, pipeline or
tensor parallelism, and with every feature's trace present: composition_evidence.py) or is
**refused at initialize** with an error carrying the words of one of its refused pairs.
"""
from __future__ import annotations

import copy
import itertools
from typing import Any

import composition as matrix

#: features the fuzzer adds to the matrix's, and what each does to a run
EXTRA: dict[str, str] = {
    "zero_init": "the model is built under zkit.zero.Init(config_dict_or_path=<the run's config>)",
    "param_groups": "model_parameters in 2 groups: the weight matrices, and the rest with lr 5e-3 and no weight "
                    "decay",
    "partial_freeze": "the first two layers frozen (requires_grad False): with the pipeline, its whole first stage",
    "lamb": "the config's optimizer is Lamb (lr 1e-2, weight decay 0.01)",
    "scheduler": "the config's scheduler is WarmupLR from 0 to 1e-2 over 4 steps",
    "save_mid_accum": "2 micro-batches per step; save_checkpoint after the first micro-batch of the last step, then "
                      "a new engine loads it and takes the second micro-batch and the step",
    "reshard": "as save_load, but the new engine runs another ZeRO stage (0->1, 1->2, 2->1, 3->2; 2->3 with "
               "step_in_backward or cpu_step_in_backward)",
    "ds_import": "the real DeepSpeed (.venv-peers) takes the first 2 steps at ZeRO 2 (3 with zero3 or "
                 "param_offload) and saves; the engine loads DeepSpeed's checkpoint and takes the last step",
}
#: the matrix's 4- and 8-rank layouts stay in the matrix: the fuzzer runs 2 ranks
FEATURES: dict[str, str] = {**{f: d for f, d in matrix.FEATURES.items() if f != "pipeline_dp"}, **EXTRA}
#: features that define what is computed: the reference keeps them
NUMERICS = (*matrix.NUMERICS, "param_groups", "partial_freeze", "lamb", "scheduler")
OPTIMIZERS = ("onebit_adam", "zeroone_adam", "lamb")
CHECKPOINTS = ("save_load", "dcp_checkpoint", "save_mid_accum", "reshard", "ds_import")
#: the offloads that step in backward (stages 2-3 only: a reshard of theirs goes between those)
STEPS_IN_BACKWARD = {"step_in_backward", "cpu_step_in_backward"}
#: the numerics DeepSpeed's side of ds_import reproduces (composition_fuzz_peer.py)
DEEPSPEED_NUMERICS = ("tied_weights", "scheduler")

#: pairs initialize refuses beyond the matrix's: why, and the words its error must contain
REFUSED: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {
    **matrix.REFUSED,
    **{(offload, "lamb"): ("as for onebit_adam: state swapped from NVMe is stepped sub-group by sub-group",
                           ("lamb", "nvme")) for offload in ("nvme_offload", "step_in_backward")},
    ("cpu_step_in_backward", "lamb"): ("as for onebit_adam: each unit steps on its own during backward, which only "
                                       "zkit-offload's fused CPU optimizers do",
                                       ("step_in_backward", "fused cpu optimizers", "lamb")),
    ("pipeline", "zero_init"): ("Init partitions every layer over all ranks; each stage keeps only its own, so "
                                "the stages cannot gather them back",
                                ("zkit.zero.init", "pipeline")),
}
#: pairs initialize refuses at some ZeRO stages only (the stage a set runs at: given, or an offload's
#: default): those stages, why, and the words its error must contain
REFUSED_AT_STAGE: dict[tuple[str, str], tuple[tuple[int, ...], str, tuple[str, ...]]] = {
    ("pipeline", "tied_weights"): ((2,), "stage 2 frees each gradient into its shard during backward, before the "
                                         "tied embedding's gradients are summed over the stages",
                                   ("zero stage 2", "tiedlayerspec", "pipeline")),
    ("onebit_adam", "custom_comm"): ((1, 2), "OneBitAdam at stages 1 and 2 reduces its gradients through the "
                                             "'onebit' communicator, which it compresses at the freeze step",
                                     ("onebitadam", "'onebit' communicator", "zkit.stack(communicator=...)")),
}
#: sets of more than two features initialize refuses at some ZeRO stages (no pair of them is refused):
#: those stages, why, and the words its error must contain
REFUSED_SETS: dict[tuple[str, ...], tuple[tuple[int, ...], str, tuple[str, ...]]] = {
    (need, "nvme_offload", "tensor_parallel"): (
        (2, 3), "the global gradient norm (clipping, fp16's overflow check) of a tensor-parallel model weighs its "
                "replicated parameters by their reduced gradients, which NVMe offload keeps in its master store "
                "from stage 2 on", ("global gradient norm", "offload_optimizer.device 'nvme'"))
    for need in ("clipping", "fp16")
}
#: pairs whose checkpoint round trip is refused (at the save or the load) beyond the matrix's
REFUSED_AT_CHECKPOINT: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {
    **matrix.REFUSED_AT_CHECKPOINT,
    ("dcp_checkpoint", "scheduler"): ("DCP holds no LR schedule: refused at the load",
                                      ("dcp", "lr scheduler", "load_lr_scheduler_states=false")),
    **{(split, "ds_import"): ("DeepSpeed's checkpoint is of the unsplit model, which loads only into an unsplit "
                              "model: refused at the load",
                              ("deepspeed checkpoint of an unsplit model", "pipeline or tensor-parallel"))
       for split in ("pipeline", "tensor_parallel")},
}
#: what this harness cannot run: 4 ranks; a pipeline takes a whole batch at once (no saving
#: between micro-batches); a stage to reshard to (param_offload needs 3, ZeroOneAdam 0); numerics
#: and a sequence-parallel model DeepSpeed's side of ds_import does not reproduce
HARNESS_LIMITS: list[frozenset[str]] = [
    frozenset({"pipeline", "tensor_parallel"}),
    frozenset({"pipeline", "save_mid_accum"}),
    frozenset({"reshard", "param_offload"}),
    frozenset({"reshard", "zeroone_adam"}),
    frozenset({"ds_import", "sequence_parallel"}),
    *(frozenset({"ds_import", f}) for f in NUMERICS if f not in DEEPSPEED_NUMERICS),
]
#: pairs never drawn together: two values of one setting (the matrix's, the config's optimizer,
#: one checkpoint per run), the harness's limits, and the pairs the matrix leaves to other tests
NOT_DRAWN: set[frozenset[str]] = {
    *(frozenset(p) for p in matrix.NOT_A_COMBINATION),
    *(frozenset(p) for p in matrix.ELSEWHERE),
    *(frozenset(p) for p in itertools.combinations(OPTIMIZERS, 2)),
    *(frozenset(p) for p in itertools.combinations(CHECKPOINTS, 2)),
    *HARNESS_LIMITS,
}


def canonical(features) -> tuple[str, ...]:
    """A set of features in the model's order (the form results are keyed by)."""
    order = list(FEATURES)
    return tuple(sorted(set(features), key=order.index))


def drawable(features: tuple[str, ...]) -> bool:
    """Whether the fuzzer may draw (or shrink to) this set."""
    return bool(features) and not any(pair <= set(features) for pair in NOT_DRAWN)


def _stage(features: tuple[str, ...]) -> Any:
    """The ZeRO stage a set runs at (a list where it names several: refused)."""
    return matrix.config(tuple(f for f in features if f in matrix.FEATURES), "")["zero_optimization"]["stage"]


def _in_force(features: tuple[str, ...]) -> tuple[str, ...]:
    """The features whose settings a run uses: a client optimizer wins over the config's optimizer
    section (as in DeepSpeed), so that section's pairs are neither refused nor run."""
    return tuple(f for f in features if f not in OPTIMIZERS) if "client_sgd" in features else features


def _refused(features: tuple[str, ...], table: dict, stage: Any) -> list[tuple[str, ...]]:
    """The pairs of ``features`` in force that ``table`` refuses, or that are refused at ``stage``,
    and the sets refused at ``stage``."""
    in_force = _in_force(features)
    return [pair for pair in itertools.combinations(in_force, 2)
            if pair in table or pair[::-1] in table or stage in REFUSED_AT_STAGE.get(pair, ((),))[0]] + [
        refused for refused, (stages, *_) in REFUSED_SETS.items() if set(refused) <= set(in_force) and stage in stages]


def _words(pair: tuple[str, ...], table: dict) -> tuple[str, ...]:
    """The words the refusal of ``pair`` (a pair or a set) must contain."""
    for by_stage in (REFUSED_SETS, REFUSED_AT_STAGE):
        if pair in by_stage:
            return by_stage[pair][2]
    return table[pair][1] if pair in table else table[pair[::-1]][1]


def refused_pairs(features: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The pairs of ``features`` initialize must refuse (those refused at one stage when the set runs at it)."""
    return _refused(features, REFUSED, _stage(features))


def refusal_words(pair: tuple[str, ...]) -> tuple[str, ...]:
    return _words(pair, REFUSED)


def refused_checkpoint_pairs(features: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The pairs of ``features`` whose checkpoint round trip must be refused (with ``reshard``, the
    pairs refused at the stage it loads at: the loading engine's initialize refuses them)."""
    stage = _stage(features)
    loads_at = None
    if "reshard" in features and isinstance(stage, int):
        loads_at = {2: 3, 3: 2}.get(stage) if STEPS_IN_BACKWARD & set(features) else load_stage(features, stage)
    return _refused(features, REFUSED_AT_CHECKPOINT, loads_at)


def checkpoint_refusal_words(pair: tuple[str, ...]) -> tuple[str, ...]:
    return _words(pair, REFUSED_AT_CHECKPOINT)


def reference_of(features: tuple[str, ...]) -> tuple[str, ...]:
    """The numerics and model features: the run a set must equal. A client optimizer wins over
    the config's optimizer section."""
    kept = matrix.numerics(features, NUMERICS)
    if "client_sgd" in kept:
        kept = tuple(f for f in kept if f not in OPTIMIZERS)
    return kept


def overlap_twin(features: tuple[str, ...]) -> tuple[str, ...] | None:
    """The set a ``cpu_step_in_backward`` set must also equal bit for bit (composition.overlap_twin),
    but for a ``reshard`` whose twin loads at another stage (from 2, the overlap's at 3 and its
    twin's at 1): 1-bit compression's error feedback follows the stage's reductions."""
    micro_batches = config(features, "")["gradient_accumulation_steps"]
    twin = matrix.overlap_twin(features, micro_batches, list(FEATURES))
    if twin is not None and "reshard" in features:
        saved = _stage(features)
        if isinstance(saved, int) and load_stage(features, saved) != load_stage(twin, saved):
            return None
    return twin


def tolerance(features: tuple[str, ...]) -> float:
    """The matrix's tolerance for the features in force: a client's SGD over the 1-bit
    communicator compresses from step 1 even when the ignored config section names OneBitAdam,
    which would have kept compression off in its warm-up."""
    return matrix.tolerance(_in_force(features))


def scale_floor(features: tuple[str, ...]) -> float:
    return matrix.scale_floor(_in_force(features))


#: features that sum a step's fp16 or bf16 gradients in another order than the reference's (micro-batches
#: accumulated one after the other, tensor-parallel partial products)
REORDERS_FP16_SUMS = ("grad_accum", "save_mid_accum", "pipeline", "tensor_parallel")
#: the largest learning rate of any run here (AdamW's, Lamb's, WarmupLR's peak; param_groups' other 5e-3)
LEARNING_RATE = 1e-2
#: the share of a model's elements that may be rounding-decided (see rounding_decided)
ROUNDING_DECIDED_SHARE = 0.01


def rounding_decided(features: tuple[str, ...], numel: int) -> tuple[int, float] | None:
    """How many of a model's ``numel`` elements may exceed :func:`tolerance`, and by how much at
    most (absolute), or ``None`` where none may.

    Adam's update ``m / (sqrt(v) + eps)`` is about ``lr * sign(g)`` in its first steps, however small
    ``g``: an element whose gradient lies within fp16's rounding of zero steps by ``+lr``, ``0`` or
    ``-lr`` according to the order its fp16 terms were summed in. In the tied GPT with fp16,
    ``layers.1.ln_2.weight[1]``'s first gradient is -1.1e-5 in fp32 against 4.8e-2 for the tensor's
    largest: +7.6e-6 in fp16 over 2-row micro-batches, exactly 0 accumulated over 1-row ones, so
    the two runs end one step (0.0095) apart; the real DeepSpeed's fp16 runs of 1 and 2 micro-batches
    at ZeRO stage 2 end 0.019 apart there, bit for bit zkit's same runs. So a set that reorders the
    sums (:data:`REORDERS_FP16_SUMS`) under an Adam optimizer may have a few such elements (measured:
    at most 6 of 2096, with tensor parallelism), each at most ``2 * lr`` apart per step (each run's
    step is within 1.004 lr in the first 3 steps: Cauchy-Schwarz over Adam's bias-corrected
    averages); every other element keeps the tolerance. bf16 rounds the same way, coarser: ZeRO 2
    with bf16 accumulated over the tied GPT ends one element (of 2096) one step apart; comm_bf16
    rounds each reduced gradient the same way (ranks' gradients that nearly cancel: the rounding
    decides the sign of their sum). A defect (a
    gradient scaled, unscaled or summed twice) moves whole tensors, not 1% of the model."""
    sixteen_bit = {"fp16", "bf16"} & set(features) or ("comm_bf16" in features and matrix.reduces(features))
    if not sixteen_bit or not set(REORDERS_FP16_SUMS) & set(features):
        return None
    if {"lamb", "client_sgd"} & set(features):  # not Adam: no sign-like first steps
        return None
    import composition_ranks  # torch: not for the pages that only read the model's tables

    return max(1, int(numel * ROUNDING_DECIDED_SHARE)), 2 * 1.01 * LEARNING_RATE * composition_ranks.STEPS


def deepspeed_run(features: tuple[str, ...]) -> tuple[tuple[str, ...], int] | None:
    """What DeepSpeed's side of a ``ds_import`` set runs: its numerics features and a ZeRO stage."""
    if "ds_import" not in features:
        return None
    return reference_of(features), 3 if {"zero3", "param_offload"} & set(features) else 2


def load_stage(features: tuple[str, ...], saved: int) -> int:
    """The stage a ``reshard`` run loads at."""
    if STEPS_IN_BACKWARD & set(features):
        return {2: 3, 3: 2}[saved]
    return {0: 1, 1: 2, 2: 1, 3: 2}[saved]


def config(features: tuple[str, ...], nvme_path: str) -> dict[str, Any]:
    """The config of a run: the matrix's, then the extra features."""
    base = tuple(f for f in features if f in matrix.FEATURES)
    if "save_mid_accum" in features and "grad_accum" not in base:
        base = (*base, "grad_accum")
    cfg = matrix.config(base, nvme_path)
    if "lamb" in features and not {"onebit_adam", "zeroone_adam"} & set(features):
        cfg["optimizer"] = {"type": "Lamb", "params": {"lr": 1e-2, "weight_decay": 0.01}}
        if "client_sgd" in features:
            del cfg["optimizer"]
    if "scheduler" in features:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 4, "warmup_type": "linear"}}
    return cfg


def resharded(cfg: dict[str, Any], features: tuple[str, ...]) -> dict[str, Any]:
    """The config a ``reshard`` run loads its checkpoint with."""
    out = copy.deepcopy(cfg)
    out["zero_optimization"]["stage"] = load_stage(features, cfg["zero_optimization"]["stage"])
    return out


def feature_sets(min_size: int = 3, max_size: int = 5):
    """The hypothesis strategy: a drawable set of ``min_size``-``max_size`` features."""
    from hypothesis import strategies as st

    return (st.lists(st.sampled_from(list(FEATURES)), min_size=min_size, max_size=max_size, unique=True)
            .map(canonical).filter(drawable))
