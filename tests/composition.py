"""The composition matrix: every pair of features, and what it must do.

Each feature changes a base run (2 ranks, ZeRO stage 0, fp32, AdamW, 3 steps of a four-layer
network with two residual blocks, a global batch of 4 rows; with a model feature, a 2-block GPT on
4 sequences of 32 tokens).
A pair either **matches its reference** or is **refused at initialize** with an error that names
both features (the words in :data:`REFUSED`); a pair with a checkpoint feature may instead have its
save or load refused, naming both (:data:`REFUSED_AT_CHECKPOINT`). The reference of a pair is the run with only its
*numerics and model* features (dtype, clipping, the optimizer, the GPT) at stage 0 on 2 ranks
without offload, accumulation or checkpointing: the other features (stages, offload,
accumulation, activation checkpointing, pipeline and tensor parallelism) must not change what is
computed. Pairs of :data:`ELSEWHERE` are covered by other tests. ``tests/test_composition.py`` runs
every cell (those with a 4-rank feature in a process group of their own);
``python tests/composition.py > docs/compatibility.md`` writes the table from this file, and a test
checks the document is what this file says.
"""
from __future__ import annotations

import itertools
from typing import Any

#: every feature of the matrix and what it does to the base run
FEATURES: dict[str, str] = {
    "zero1": "ZeRO stage 1",
    "zero2": "ZeRO stage 2",
    "zero3": "ZeRO stage 3",
    "cpu_offload": "offload_optimizer cpu (stage 2 unless a stage is given)",
    "nvme_offload": "offload_optimizer nvme (stage 2 unless a stage is given)",
    "step_in_backward": "offload_optimizer nvme with step_in_backward: each sub-group steps during the batch's last "
                        "backward (stage 2 unless a stage is given)",
    "cpu_step_in_backward": "ZeRO-Offload overlapped: offload_optimizer cpu with step_in_backward: each unit's "
                            "gradients go to the host as backward delivers them and the host optimizer steps the "
                            "unit on a thread of its own during the batch's last backward (stage 2 unless a stage "
                            "is given). Besides its reference, the cell equals bit for bit the same cell with "
                            "cpu_offload, the step after backward (but for bf16 steps of several micro-batches, "
                            "which the overlap adds in fp32 and the step after backward on a CPU-only machine in "
                            "bf16)",
    "param_offload": "offload_param cpu (stage 3)",
    "bf16": "bf16 training",
    "fp16": "fp16 training, dynamic loss scale",
    "grad_accum": "2 micro-batches of half the size per step",
    "clipping": "gradient_clipping 0.05",
    "act_ckpt": "activation checkpointing of each block (zkit.activations.recompute, cpu_checkpointing)",
    "act_ckpt_plain": "activation checkpointing of each block through zkit.activations.recompute with the "
                      "activation_checkpointing section present and every option off: each region is torch's "
                      "non-reentrant checkpoint alone (traced into the compiled graph under compile). The run "
                      "shows that no region needed the eager bookkeeping path and that blocks were recomputed "
                      "in backward (with compile: that the compiled graphs hold the checkpointed regions; where a "
                      "region holds what Dynamo cannot trace, block_sparse's CPU kernel, torch runs the whole "
                      "region eagerly at a graph break, and its recomputation in backward is the trace; stage 3 compiles each "
                      "block's forward inside the checkpoint, and its recomputations must run compiled). A seeded "
                      "tensor-parallel RNG tracker "
                      "(zkit_pipeline.model_parallel_seed) would send the regions down the eager path; "
                      "tensor_parallel here does not seed it",
    "onebit_adam": "zkit-onebit's OneBitAdam in its warm-up (freeze_step past the run: the 1-bit phase's "
                   "own tests compare it with its simulation)",
    "client_sgd": "a client torch.optim.SGD instance (momentum 0.9) passed to initialize",
    "pipeline": "zkit-pipeline: the model as a PipelineModule of 2 stages (one replica), train_batch over the "
                "same global batch in micro-batches",
    "save_load": "save_checkpoint after 2 of the 3 steps, then a new engine loads it and takes the last step",
    "dcp_checkpoint": "as save_load, through PyTorch's Distributed Checkpoint: the checkpoint written as a DCP "
                      "directory (zkit.checkpoint.dcp.write_dcp), which the new engine loads",
    "custom_allocator": "a third-party allocator record chosen by zkit.Stack(allocator=...)",
    "custom_comm": "a third-party communicator record chosen by zkit.Stack(communicator=...): torch's, behind a "
                   "wrapper that counts the calls; the engine's gradients and (with pipeline or tensor "
                   "parallelism) the grid's groups go through it",
    "tensor_parallel": "zkit-pipeline's TensorParallelModule over the 2 ranks (one replica): each block's MLP a "
                       "column- then a row-parallel linear, the rest replicated",
    "block_sparse": "the model is a 2-block GPT (zkit.models.gpt.Block, 32 tokens) with GPTConfig(attention="
                    "\"block_sparse\") (zkit-sparse, fixed layout of 8-token blocks, 2 local: not dense attention)",
    "tied_weights": "the model is the 2-block GPT with dense attention and its token embedding tied to the head "
                    "(in a pipeline, a TiedLayerSpec that both stages hold, their gradients summed; the head's "
                    "norm a layer of its own)",
    "zeroone_adam": "zkit-onebit's ZeroOneAdam in its first variance phase (every step a variance step: its "
                    "compressed steps are compared with their simulation in its own tests)",
    "onebit_comm": "zkit-onebit's OneBitCommunicator chosen by zkit.Stack(communicator=...) with the config's "
                   "AdamW, compressing tensors of 32 elements and more (its default threshold, 4096, is above "
                   "every gradient bucket here): the cell must send bytes 1-bit compressed and, as compression "
                   "changes the numbers, equal its reference within 0.3 of each tensor's largest weight (counted "
                   "as at least 0.1); exact where nothing is compressed: with OneBitAdam or ZeroOneAdam (they keep "
                   "compression off in their warm-up) and with one data-parallel replica (pipeline, tensor "
                   "parallelism: no gradient is reduced)",
    "compile": "the module's forward compiled by engine.compile(backend=zkit.testing.CountingBackend()) after "
               "initialize (aot_eager; the engine's hooks, reductions and step stay eager)",
    "overlap_gather": "zero_optimization.overlap_param_gather (stage 2 unless a stage is given): the parameter "
                      "all-gathers after each step run in the background and the next forward waits for each unit "
                      "at the first use of one of its parameters; as documented it applies at stages 1-2 over "
                      "several replicas, and has no effect (initialize warns) at stage 3 (parameters are gathered "
                      "per forward) or with one data-parallel replica (pipeline, tensor parallelism: nothing to "
                      "gather)",
    "offload_states": "after each step, engine.offload_states() then engine.reload_states() (DeepSpeed's calls): "
                      "every kind of state the engine holds on its device moved to host buffers, its storages "
                      "emptied, then brought back (with offload_optimizer the master and optimizer state are on "
                      "the host already and stay there)",
    "predivide": "gradient_predivide_factor 2.0: each rank's gradients are divided by 2 before a summing "
                 "reduction and multiplied by 2/world after it (DeepSpeed's key), in place of the averaging "
                 "reduction; dividing by a power of two is exact in every dtype, so the pair keeps its "
                 "reference's tolerance",
    "pipeline_dp": "zkit-pipeline: a PipelineModule of 2 stages x 2 data-parallel replicas on 4 ranks (run as a "
                   "group of its own, against the 2-rank references)",
    "sequence_parallel": "zkit-sequence: sequence_parallel_size 2 over the 2 ranks (one data-parallel replica), the "
                         "model the GPT with its attention the ulysses record around its own (dense, or block_sparse); "
                         "each rank takes its half of every sequence with its position ids, and the loss is the "
                         "sequence-mean cross-entropy (zkit_sequence.sequence_cross_entropy). The gradients are still "
                         "reduced over both ranks (ZeRO shards over every data x sequence rank). The run shows the "
                         "all-to-alls went through the sequence group's communicator and every attention was bound "
                         "to it",
    "comm_bf16": "communication_data_type \"bf16\" (DeepSpeed's key): each rank's gradients are rounded to bf16 and "
                 "reduced in bf16, then used in the training dtype. The rounding is what is computed, so the "
                 "reference keeps it: at 2 ranks every stage rounds the same per-rank values once and sums two "
                 "of them (rounded once, halved exactly), so the pair keeps its reference's tolerance (a bf16 "
                 "tolerance would hide a gradient scaled by 1%). The run shows every gradient reduction went "
                 "out in bf16 (the partitioner's communicator, spied). With one data-parallel replica (pipeline, "
                 "tensor parallelism) at ZeRO stage 0 or 1 nothing is reduced and it has no effect: the "
                 "reference drops it there (at stages 2-3 the one-rank bucket still rounds to bf16)",
}
#: features that define what is computed (the numerics and the model): a pair's reference keeps these
NUMERICS = ("bf16", "fp16", "clipping", "onebit_adam", "zeroone_adam", "client_sgd", "tied_weights",
            "block_sparse", "comm_bf16")
#: features with a model of a transformer's layers (the others train the residual network)
GPT_FEATURES = ("block_sparse", "tied_weights", "sequence_parallel", "gpt")
#: not a feature of the matrix: the dense GPT, which a model feature that does not change what is
#: computed (sequence_parallel) keeps in its reference
GPT_MODEL = "gpt"
#: features whose blocks hold what Dynamo cannot trace (zkit-sparse's CPU kernel): under compile a
#: checkpointed block of theirs runs eagerly as a whole
UNTRACEABLE_BLOCKS = ("block_sparse",)
#: cells that run on 4 ranks, in a process group of their own: those with a feature of FOUR_RANKS,
#: and those with every feature of a set in FOUR_RANK_PAIRS (2 stages x 2 tensor ranks)
FOUR_RANKS = ("pipeline_dp",)
FOUR_RANK_PAIRS = ({"pipeline", "tensor_parallel"},)
#: cells with every feature of a set here run on 8 ranks (2 stages x 2 tensor ranks x 2 replicas)
EIGHT_RANK_PAIRS = ({"pipeline_dp", "tensor_parallel"},)
STAGES = ("zero1", "zero2", "zero3")
#: the offload_optimizer features: one section's values (device, step_in_backward)
OFFLOADS = ("cpu_offload", "nvme_offload", "step_in_backward", "cpu_step_in_backward")

#: pairs refused at initialize: why, and words the error must contain (it names both features)
REFUSED: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {
    ("zero1", "zero2"): ("one stage per run", ("zero_optimization.stage", "must be an int")),
    ("zero1", "zero3"): ("one stage per run", ("zero_optimization.stage", "must be an int")),
    ("zero2", "zero3"): ("one stage per run", ("zero_optimization.stage", "must be an int")),
    ("zero1", "param_offload"): ("only stage 3 partitions parameters", ("offload_param", "stage 3", "stage 1")),
    ("zero2", "param_offload"): ("only stage 3 partitions parameters", ("offload_param", "stage 3", "stage 2")),
    ("bf16", "fp16"): ("one training dtype", ("bf16", "fp16")),
    ("zero3", "onebit_adam"): ("stage 3 gathers layer by layer; the 1-bit exchange needs a step's whole gradient",
                               ("onebitadam", "stage 3")),
    ("param_offload", "onebit_adam"): ("parameter offload is stage 3 (as above)", ("onebitadam", "stage 3")),
    ("nvme_offload", "onebit_adam"): ("state swapped from NVMe is stepped sub-group by sub-group, which only the "
                                      "fused CPU optimizers do", ("onebitadam", "nvme")),
    ("nvme_offload", "client_sgd"): ("as above: SGD has no sub-group step", ("sgd", "nvme")),
    ("zero3", "pipeline"): ("stage 3 gathers parameters per forward, which the pipeline's chunks do not do",
                            ("zero stage 3", "pipeline")),
    ("param_offload", "pipeline"): ("parameter offload is stage 3 (as above)", ("zero stage 3", "pipeline")),
    ("zero3", "pipeline_dp"): ("as for pipeline", ("zero stage 3", "pipeline")),
    ("param_offload", "pipeline_dp"): ("as for pipeline", ("zero stage 3", "pipeline")),
    ("cpu_offload", "custom_allocator"): ("offload needs zkit-offload's allocator; another would silently not "
                                          "offload", ("allocator 'host'", "allocator='counting'", "offload")),
    ("nvme_offload", "custom_allocator"): ("as above", ("allocator 'nvme'", "allocator='counting'", "offload")),
    ("param_offload", "custom_allocator"): ("as above", ("allocator 'host'", "allocator='counting'", "offload")),
    **{(stage, "zeroone_adam"): ("0/1 Adam's local steps need every rank to hold the whole optimizer state",
                                 ("zerooneadam", f"stage {stage[-1]}")) for stage in STAGES},
    **{(offload, "zeroone_adam"): ("offload is a ZeRO stage (as above)", ("zerooneadam", "stage"))
       for offload in ("cpu_offload", "param_offload")},
    ("zeroone_adam", "overlap_gather"): ("overlap_param_gather runs at stage 2 unless a stage is given (as above)",
                                         ("zerooneadam", "stage 2")),
    ("nvme_offload", "zeroone_adam"): ("as for onebit_adam: state swapped from NVMe is stepped sub-group by "
                                       "sub-group", ("zerooneadam", "nvme")),
    ("zero1", "step_in_backward"): ("stage 1 keeps the master in memory: there is no sub-group of master and "
                                    "gradients to step", ("step_in_backward", "stage 2 or 3", "stage 1")),
    ("step_in_backward", "fp16"): ("the loss scaler skips an overflowing step, known only after the last gradient",
                                   ("step_in_backward", "fp16.enabled")),
    ("step_in_backward", "clipping"): ("clipping needs the global norm, known only after the last gradient",
                                       ("step_in_backward", "gradient_clipping")),
    ("step_in_backward", "onebit_adam"): ("as for nvme_offload", ("onebitadam", "nvme")),
    ("step_in_backward", "client_sgd"): ("as for nvme_offload", ("sgd", "nvme")),
    ("step_in_backward", "custom_allocator"): ("as for nvme_offload", ("allocator 'nvme'", "allocator='counting'",
                                                                       "offload")),
    ("step_in_backward", "zeroone_adam"): ("as for nvme_offload", ("zerooneadam", "nvme")),
    ("zero1", "cpu_step_in_backward"): ("as for step_in_backward: stage 1's gradients do not reach the host "
                                        "master unit by unit", ("step_in_backward", "stage 2 or 3", "stage 1")),
    ("cpu_step_in_backward", "fp16"): ("as for step_in_backward", ("step_in_backward", "fp16.enabled")),
    ("cpu_step_in_backward", "clipping"): ("as for step_in_backward", ("step_in_backward", "gradient_clipping")),
    ("cpu_step_in_backward", "onebit_adam"): ("each unit steps on its own during backward, which only "
                                              "zkit-offload's fused CPU optimizers do",
                                              ("step_in_backward", "fused cpu optimizers", "onebitadam")),
    ("cpu_step_in_backward", "client_sgd"): ("as above", ("step_in_backward", "fused cpu optimizers", "sgd")),
    ("cpu_step_in_backward", "custom_allocator"): ("as for cpu_offload", ("allocator 'host'",
                                                                          "allocator='counting'", "offload")),
    ("cpu_step_in_backward", "zeroone_adam"): ("as for onebit_adam", ("step_in_backward", "fused cpu optimizers",
                                                                   "zerooneadam")),
    **{(split, "sequence_parallel"): ("sequence parallelism splits the whole world into sequence groups; a pipeline "
                                      "or tensor-parallel model brings a data-parallel group of its own",
                                      ("sequence_parallel_size", "pipeline or tensor parallelism"))
       for split in ("pipeline", "tensor_parallel", "pipeline_dp")},
}
#: pairs initialize accepts whose checkpoint round trip is refused, at the save (the DCP export) or
#: at the load, with an error naming both: why, and the words the error must contain. A DCP
#: checkpoint holds one whole model's weights and per-parameter optimizer state, nothing else
REFUSED_AT_CHECKPOINT: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {
    ("onebit_adam", "dcp_checkpoint"): ("DCP does not hold the 1-bit optimizer's step count and phase: refused at "
                                        "the load", ("dcp", "onebitadam", "load_optimizer_states=false")),
    ("fp16", "dcp_checkpoint"): ("DCP does not hold the dynamic fp16 loss scale: refused at the load",
                                 ("dcp", "loss scale", "load_optimizer_states=false")),
    ("pipeline", "dcp_checkpoint"): ("a DCP export writes one whole model, not pipeline stages: refused at the "
                                     "save", ("dcp", "pipeline stages")),
    ("dcp_checkpoint", "tensor_parallel"): ("as pipeline: not tensor-parallel slices", ("dcp", "tensor-parallel")),
    ("dcp_checkpoint", "zeroone_adam"): ("as onebit_adam", ("dcp", "zerooneadam", "load_optimizer_states=false")),
    ("dcp_checkpoint", "pipeline_dp"): ("as pipeline", ("dcp", "pipeline stages")),
}
#: two values of one setting, not a combination: the stage pairs and bf16 x fp16 must be refused
#: by the config; the offload features (two devices, each with and without step_in_backward: one
#: section's values), the two 1-bit optimizers, the two pipeline layouts, the two checkpoint
#: formats, the two communicators a Stack chooses and the two activation_checkpointing sections
#: are one key's (or one model's, or one argument's, or one section's) two values
NOT_A_COMBINATION = {("zero1", "zero2"), ("zero1", "zero3"), ("zero2", "zero3"), ("bf16", "fp16"),
                     *itertools.combinations(OFFLOADS, 2), ("onebit_adam", "zeroone_adam"),
                     ("pipeline", "pipeline_dp"), ("save_load", "dcp_checkpoint"), ("custom_comm", "onebit_comm"),
                     ("act_ckpt", "act_ckpt_plain")}
#: pairs the matrix does not run, and the test that covers them (or why none does)
ELSEWHERE: dict[tuple[str, str], str] = {
    ("param_offload", "offload_states"): ("initialize accepts it: offload_states() is a call made later, which "
                                          "refuses parameters that already live off the device, as DeepSpeed's "
                                          "does (tests/test_offload_states.py::"
                                          "test_offloaded_parameters_and_no_optimizer_are_refused)"),
}


def pairs() -> list[tuple[str, str]]:
    return list(itertools.combinations(FEATURES, 2))


def ranks(cell: tuple[str, ...]) -> int:
    """How many ranks a cell runs on."""
    if any(pair <= set(cell) for pair in EIGHT_RANK_PAIRS):
        return 8
    four = any(f in FOUR_RANKS for f in cell) or any(pair <= set(cell) for pair in FOUR_RANK_PAIRS)
    return 4 if four else 2


def expected(pair: tuple[str, str]) -> str:
    if pair in REFUSED:
        return "refused"
    return "refused at checkpoint" if pair in REFUSED_AT_CHECKPOINT else "matches"


def reference_of(pair: tuple[str, str]) -> tuple[str, ...]:
    """The numerics and model features of a pair: the run its result must equal. A client
    optimizer wins over the config's optimizer section."""
    kept = numerics(pair, NUMERICS)
    if "client_sgd" in kept:
        return tuple(f for f in kept if f not in ("onebit_adam", "zeroone_adam"))
    return kept


def overlap_twin(features: tuple[str, ...], micro_batches: int | None = None,
                 order: list[str] | None = None) -> tuple[str, ...] | None:
    """The run a ``cpu_step_in_backward`` run must also equal, bit for bit: the same features with
    ``cpu_offload``, the step after backward, whose update the overlap promises to make exactly
    (zkit_offload.host_master). ``None`` for other runs, and for bf16 steps of several
    micro-batches (``micro_batches``: the config's unless given): the overlap adds their
    gradients in its fp32 host buffers, where the step after backward on a CPU-only machine adds
    them in bf16 (with an accelerator, on the host in fp32 too); those keep their reference's
    tolerance. ``order``: the feature order of the result (the matrix's unless given)."""
    if "cpu_step_in_backward" not in features:
        return None
    if micro_batches is None:
        micro_batches = config(features, "")["gradient_accumulation_steps"]
    if "bf16" in features and micro_batches > 1:
        return None
    order = list(FEATURES) if order is None else order
    return tuple(sorted({"cpu_offload" if f == "cpu_step_in_backward" else f for f in features}, key=order.index))


def numerics(features: tuple[str, ...], kinds: tuple[str, ...]) -> tuple[str, ...]:
    """The features of ``kinds`` that change what ``features`` compute: ``comm_bf16`` rounds the
    reduced gradients, and with one data-parallel replica at stages 0-1 nothing is reduced. A
    sequence-parallel run's reference is the GPT on the whole sequence."""
    kept = tuple(f for f in features if f in kinds and not (f == "comm_bf16" and not reduces(features)))
    if "sequence_parallel" in features and not set(kept) & set(GPT_FEATURES):
        kept = (*kept, GPT_MODEL)
    return kept


def reduces(features: tuple[str, ...]) -> bool:
    """Whether a run's gradients go through a reduction: over several replicas, or at stages 2-3
    (whose buckets are reduce-scattered even on one rank)."""
    stage = config(tuple(f for f in features if f in FEATURES), "")["zero_optimization"]["stage"]
    return reduced_over(features) > 1 or (isinstance(stage, int) and stage >= 2)


def compresses(features: tuple[str, ...]) -> bool:
    """Whether a run's gradients travel 1-bit compressed: not with one data-parallel replica (there
    is no gradient to reduce), nor under a 1-bit optimizer (it keeps compression off in its
    warm-up, which is as far as these runs go)."""
    return ("onebit_comm" in features and reduced_over(features) > 1
            and not {"onebit_adam", "zeroone_adam"} & set(features))


def tolerance(features: tuple[str, ...]) -> float:
    """Relative tolerance of a cell's parameters against its reference."""
    if compresses(features):
        return 3e-1  # sign and scale per chunk: each step moves a weight by up to Adam's lr more or less
        # (of a tensor's largest weight, counted as at least SCALE_FLOOR: see scale_floor)
    if "bf16" in features and "tensor_parallel" in features:
        return 1e-1  # and each tensor rank rounds its partial product to bf16 before they are summed
    if "bf16" in features or {"comm_bf16", "sequence_parallel"} <= set(features):
        # bf16 keeps 8 bits: accumulating two micro-batches rounds differently from one; with sequence
        # parallelism each rank's gradient (of half of every sequence, the reference's of half the rows)
        # rounds to bf16 differently in every element, and Adam turns those of nearly cancelling halves
        # into steps of either sign
        return 5e-2
    if "fp16" in features or rounds_accumulated(features):
        return 2e-3
    return 1e-5


def rounds_accumulated(features: tuple[str, ...]) -> bool:
    """Whether a run rounds a sum to bf16 where its reference rounds its terms (comm_bf16 with
    accumulation; or with one replica at stages 2-3, whose one-rank bucket rounds the whole
    gradient where the 2-rank reference rounds each rank's half; or with sequence parallelism, whose
    ranks round the gradients of half of every sequence where the reference's round half the
    rows): the fp32 sums differ in their last bits, so an element
    on a bf16 rounding boundary lands one bf16 step (2^-8 of its gradient) away, which moves its
    Adam steps by about that fraction of lr (3 steps of lr 1e-2: under 3e-4, 2e-3 of a weight of
    0.15)."""
    elsewhere = {"grad_accum", "save_mid_accum"} & set(features) or replicas(features) == 1  # one rank's bucket
    return "comm_bf16" in features and reduces(features) and bool(elsewhere)


def scale_floor(features: tuple[str, ...]) -> float:
    """The least magnitude a tensor's largest weight counts as in the relative comparison: a
    compressed run's error is a few learning rates whatever the tensor's size (a layer norm's bias
    of 0.03 moves by 0.01 and more)."""
    return 1e-1 if compresses(features) else 1e-3


def replicas(features: tuple[str, ...]) -> int:
    """Data-parallel replicas of a run: a 2-stage pipeline, 2 tensor ranks or 2 sequence ranks on 2
    ranks make one; the 2 x 2 pipeline has 2 (with tensor parallelism too, on 8 ranks)."""
    if "pipeline_dp" in features:
        return 2
    return 1 if {"pipeline", "tensor_parallel", "sequence_parallel"} & set(features) else 2


def reduced_over(features: tuple[str, ...]) -> int:
    """The ranks a run's gradients are reduced over: its replicas, and with sequence parallelism
    both ranks of its one replica."""
    return 2 if "sequence_parallel" in features else replicas(features)


def config(features: tuple[str, ...], nvme_path: str) -> dict[str, Any]:
    """The config of a run with ``features`` (see :data:`FEATURES`)."""
    stages = [int(f[-1]) for f in features if f in STAGES]
    zero: dict[str, Any] = {"stage": stages[0] if len(stages) == 1 else 0, "reduce_bucket_size": 64,
                            "stage3_param_persistence_threshold": 0}
    if len(stages) > 1:
        zero["stage"] = stages  # refused: one stage only
    if "param_offload" in features:
        zero["stage"] = zero["stage"] or 3
        zero["offload_param"] = {"device": "cpu"}
    if set(OFFLOADS) & set(features):
        zero["stage"] = zero["stage"] or 2
        device = "cpu" if {"cpu_offload", "cpu_step_in_backward"} & set(features) else "nvme"
        zero["offload_optimizer"] = {"device": device, **({"nvme_path": nvme_path} if device == "nvme" else {})}
        if {"step_in_backward", "cpu_step_in_backward"} & set(features):
            zero["offload_optimizer"]["step_in_backward"] = True
    if "overlap_gather" in features:
        zero["stage"] = zero["stage"] or 2
        zero["overlap_param_gather"] = True
    # a global batch of 4 rows: one data-parallel replica takes them in 2 micro-batches of 2
    micro, accum = (2, 2) if replicas(features) == 1 else (2, 1)
    if "grad_accum" in features:
        micro, accum = micro // 2, accum * 2
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 1000,
    }
    if "bf16" in features:
        cfg["bf16"] = {"enabled": True}
    if "fp16" in features:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if "clipping" in features:
        cfg["gradient_clipping"] = 0.05
    if "predivide" in features:
        cfg["gradient_predivide_factor"] = 2.0
    if "comm_bf16" in features:
        cfg["communication_data_type"] = "bf16"
    if "sequence_parallel" in features:
        cfg["sequence_parallel_size"] = 2
    if "act_ckpt" in features:
        cfg["activation_checkpointing"] = {"cpu_checkpointing": True}
    if "act_ckpt_plain" in features:  # DeepSpeed's keys, each off: what a default section gives
        cfg["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False,
                                           "contiguous_memory_optimization": False,
                                           "synchronize_checkpoint_boundary": False, "profile": False}
    if "onebit_adam" in features:
        cfg["optimizer"] = {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 100}}
    if "zeroone_adam" in features:
        cfg["optimizer"] = {"type": "ZeroOneAdam", "params": {"lr": 1e-2, "var_freeze_step": 100}}
    if "client_sgd" in features and not {"onebit_adam", "zeroone_adam"} & set(features):
        del cfg["optimizer"]  # with a section too, the client's optimizer wins (as in DeepSpeed)
    return cfg


def markdown() -> str:
    """docs/compatibility.md."""
    names = list(FEATURES)
    lines = [
        "# Compatibility: every pair of features",
        "",
        "Written by `python tests/composition.py > docs/compatibility.md` from the matrix that",
        "`tests/test_composition.py` runs (2 ranks, gloo; pairs with "
        + ", ".join(f"`{f}`" for f in FOUR_RANKS) + " and "
        + ", ".join(" × ".join(f"`{f}`" for f in sorted(pair)) for pair in FOUR_RANK_PAIRS) + " on 4",
        "ranks and " + ", ".join(" × ".join(f"`{f}`" for f in sorted(pair)) for pair in EIGHT_RANK_PAIRS)
        + " on 8, each size in a process group of its own); a test fails when this page and the matrix differ.",
        "A cell is one of:",
        "",
        "- **=**: the pair trains and its parameters equal its reference, the same run with only the",
        "  pair's numerics and model features (dtype, clipping, optimizer, GPT model) at ZeRO stage 0",
        "  on 2 ranks without offload, accumulation, checkpointing, pipeline or tensor parallelism",
        "  (fp32 within 1e-5 relative, fp16 and bf16-reduced accumulated gradients 2e-3, bf16 and",
        "  bf16-reduced gradients of sequence-parallel ranks 5e-2,",
        "  bf16 with tensor parallelism 1e-1, 1-bit compressed gradients 3e-1 of a tensor's largest",
        "  weight counted as at least 0.1), and the run",
        "  shows that each of its features ran (`tests/composition_evidence.py`: bytes sent compressed,",
        "  state in swap files, partitions split, blocks recomputed, ...);",
        "- **refused**: `zkit.initialize` refuses it with an error naming both features;",
        "- **refused at checkpoint**: `initialize` accepts it and it trains, but its checkpoint round trip",
        "  is refused, at the save or at the load, with an error naming both features;",
        *(["- **†**: not run by the matrix: the list at the end names the test that covers the pair, or",
            "  says why none does;"] if ELSEWHERE else []),
        "- **—**: two values of one setting, not a combination.",
        "",
        "| | " + " | ".join(f"`{n}`" for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for a in names:
        row = []
        for b in names:
            if a == b:
                row.append("")
                continue
            pair = (a, b) if names.index(a) < names.index(b) else (b, a)
            row.append("—" if pair in NOT_A_COMBINATION else "†" if pair in ELSEWHERE else
                       expected(pair).replace("matches", "="))
        lines.append(f"| `{a}` | " + " | ".join(row) + " |")
    lines += ["", "## The features", "", "| feature | what it does |", "|---|---|"]
    lines += [f"| `{n}` | {d} |" for n, d in FEATURES.items()]
    lines += ["", "## Why the refused pairs are refused", ""]
    lines += [f"- `{a}` × `{b}`: {why}" for (a, b), (why, _) in REFUSED.items() if (a, b) not in NOT_A_COMBINATION]
    lines += ["", "## Why the pairs refused at checkpoint are refused", ""]
    lines += [f"- `{a}` × `{b}`: {why}" for (a, b), (why, _) in REFUSED_AT_CHECKPOINT.items()]
    if ELSEWHERE:
        lines += ["", "## Pairs covered outside the matrix (†)", ""]
        lines += [f"- `{a}` × `{b}`: {where}" for (a, b), where in ELSEWHERE.items()]
    lines += fuzzer_section()
    return "\n".join(lines) + "\n"


def fuzzer_section() -> list[str]:
    """The page's part on sets of more than two features (tests/composition_fuzz_model.py)."""
    import composition_fuzz_model as fuzz

    lines = [
        "", "## Beyond pairs: the composition fuzzer", "",
        "`tests/composition_fuzz.py` draws sets of 3-5 features (a hypothesis strategy over the matrix's",
        "2-rank features and those below), runs each with its reference in one 2-rank process group and",
        "holds it to the same rule: it equals its reference, with every feature's trace present, or",
        "`initialize` refuses it naming one of its refused pairs (or its checkpoint is refused naming one",
        "of its pairs refused at checkpoint). One allowance: an fp16 or bf16 set under an Adam optimizer whose",
        "gradients are summed in another order than its reference's",
        "(" + ", ".join(f"`{f}`" for f in fuzz.REORDERS_FP16_SUMS) + ") may have up to",
        f"{fuzz.ROUNDING_DECIDED_SHARE:.0%} of its elements beyond the tolerance, each by at most two Adam steps per "
        "step: Adam turns",
        "a gradient within the half type's rounding of zero into a whole step of either sign, which the order of the",
        "sums decides (the real DeepSpeed's fp16 runs of 1 and 2 micro-batches differ the same way).",
        "`python tests/composition_fuzz.py",
        "--examples N [--seed S]` prints each failure shrunk to a minimal set of features;",
        "`tests/test_composition_fuzz.py` runs a fixed subset. The features it adds:", "",
        "| feature | what it does |", "|---|---|",
    ]
    lines += [f"| `{n}` | {d} |" for n, d in fuzz.EXTRA.items()]
    lines += ["", "Refused beyond the matrix's pairs:", ""]
    lines += [f"- `{a}` × `{b}`: {why}" for (a, b), (why, _) in fuzz.REFUSED.items() if (a, b) not in REFUSED]
    lines += [f"- {' × '.join(f'`{f}`' for f in refused)} at ZeRO stage {' or '.join(map(str, stages))}: {why}"
              for refused, (stages, why, _) in fuzz.REFUSED_SETS.items()]
    lines += [f"- `{a}` × `{b}` (at checkpoint): {why}" for (a, b), (why, _) in fuzz.REFUSED_AT_CHECKPOINT.items()
              if (a, b) not in REFUSED_AT_CHECKPOINT]
    lines += [f"- `{a}` × `{b}` at ZeRO stage {' or '.join(map(str, stages))} (given, or the offload's default; a "
              f"`reshard` that loads at it is refused at the load): {why}"
              for (a, b), (stages, why, _) in fuzz.REFUSED_AT_STAGE.items()]
    lines += ["", "Never drawn together: two values of one setting (the pairs marked —, two optimizers of the",
              "config, two checkpoint features)" + (", the pairs marked †" if ELSEWHERE else "")
              + ", and what a 2-rank harness cannot run: "
              + ", ".join(" × ".join(f"`{f}`" for f in sorted(pair)) for pair in fuzz.HARNESS_LIMITS) + "."]
    return lines


if __name__ == "__main__":
    print(markdown(), end="")
