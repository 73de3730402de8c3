"""The composition matrix: every pair of features, and what it must do.

Each feature changes a base run (2 ranks, ZeRO stage 0, fp32, AdamW, 3 steps of a four-layer
network with two residual blocks, a global batch of 4 rows).
A pair either **matches its reference** or is **refused at initialize** with an error that names
both features (the words in :data:`REFUSED`). The reference of a pair is the run with only its
*numerics* features (dtype, clipping, the optimizer) at stage 0 without offload, accumulation or
checkpointing: the other features (stages, offload, accumulation, activation checkpointing) must
not change what is computed. ``tests/test_composition.py`` runs every cell;
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
    "param_offload": "offload_param cpu (stage 3)",
    "bf16": "bf16 training",
    "fp16": "fp16 training, dynamic loss scale",
    "grad_accum": "2 micro-batches of half the size per step",
    "clipping": "gradient_clipping 0.05",
    "act_ckpt": "activation checkpointing of each block (zkit.checkpointing, cpu_checkpointing)",
    "onebit_adam": "zkit-onebit's OneBitAdam in its warm-up (freeze_step past the run: the 1-bit phase's "
                   "own tests compare it with its simulation)",
    "client_sgd": "a client torch.optim.SGD instance (momentum 0.9) passed to initialize",
    "pipeline": "zkit-pipeline: the model as a PipelineModule of 2 stages (one replica), train_batch over the "
                "same global batch in micro-batches",
    "save_load": "save_checkpoint after 2 of the 3 steps, then a new engine loads it and takes the last step",
    "custom_allocator": "a third-party allocator record chosen by zkit.Stack(allocator=...)",
}
#: features that define what is computed: a pair's reference keeps these
NUMERICS = ("bf16", "fp16", "clipping", "onebit_adam", "client_sgd")
STAGES = ("zero1", "zero2", "zero3")

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
    ("cpu_offload", "custom_allocator"): ("offload needs zkit-offload's allocator; another would silently not "
                                          "offload", ("allocator 'host'", "allocator='counting'", "offload")),
    ("nvme_offload", "custom_allocator"): ("as above", ("allocator 'nvme'", "allocator='counting'", "offload")),
    ("param_offload", "custom_allocator"): ("as above", ("allocator 'host'", "allocator='counting'", "offload")),
}
#: two values of one setting, not a combination: the stage pairs and bf16 x fp16 must be refused
#: by the config; the two offload devices are one key's two values
NOT_A_COMBINATION = {("zero1", "zero2"), ("zero1", "zero3"), ("zero2", "zero3"), ("bf16", "fp16"),
                     ("cpu_offload", "nvme_offload")}


def pairs() -> list[tuple[str, str]]:
    return list(itertools.combinations(FEATURES, 2))


def expected(pair: tuple[str, str]) -> str:
    return "refused" if pair in REFUSED else "matches"


def reference_of(pair: tuple[str, str]) -> tuple[str, ...]:
    """The numerics features of a pair: the run its result must equal. A client optimizer wins
    over the config's optimizer section."""
    if "client_sgd" in pair and "onebit_adam" in pair:
        return ("client_sgd",)
    return tuple(f for f in pair if f in NUMERICS)


def tolerance(features: tuple[str, ...]) -> float:
    """Relative tolerance of a cell's parameters against its reference."""
    if "bf16" in features:
        return 5e-2  # bf16 keeps 8 bits: accumulating two micro-batches rounds differently from one
    if "fp16" in features:
        return 2e-3
    return 1e-5


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
    if "cpu_offload" in features or "nvme_offload" in features:
        zero["stage"] = zero["stage"] or 2
        device = "nvme" if "nvme_offload" in features else "cpu"
        zero["offload_optimizer"] = {"device": device, **({"nvme_path": nvme_path} if device == "nvme" else {})}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1 if "grad_accum" in features else 2,
        # a pipeline has one replica: twice the micro-batches make the same global batch of 4
        "gradient_accumulation_steps": (2 if "grad_accum" in features else 1) * (2 if "pipeline" in features else 1),
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
    if "act_ckpt" in features:
        cfg["activation_checkpointing"] = {"cpu_checkpointing": True}
    if "onebit_adam" in features:
        cfg["optimizer"] = {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 100}}
    if "client_sgd" in features and "onebit_adam" not in features:
        del cfg["optimizer"]  # with a section too, the client's optimizer wins (as in DeepSpeed)
    return cfg


def markdown() -> str:
    """docs/compatibility.md."""
    names = list(FEATURES)
    lines = [
        "# Compatibility: every pair of features",
        "",
        "Written by `python tests/composition.py > docs/compatibility.md` from the matrix that",
        "`tests/test_composition.py` runs (2 ranks, gloo); a test fails when this page and the matrix",
        "differ. A cell is one of:",
        "",
        "- **=**: the pair trains and its parameters equal its reference, the same run with only the",
        "  pair's numerics features (dtype, clipping, optimizer) at ZeRO stage 0 without offload,",
        "  accumulation or checkpointing (fp32 within 1e-5 relative, fp16 2e-3, bf16 5e-2);",
        "- **refused**: `zkit.initialize` refuses it with an error naming both features;",
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
            row.append("—" if pair in NOT_A_COMBINATION else ("refused" if pair in REFUSED else "="))
        lines.append(f"| `{a}` | " + " | ".join(row) + " |")
    lines += ["", "## The features", "", "| feature | what it does |", "|---|---|"]
    lines += [f"| `{n}` | {d} |" for n, d in FEATURES.items()]
    lines += ["", "## Why the refused pairs are refused", ""]
    lines += [f"- `{a}` × `{b}`: {why}" for (a, b), (why, _) in REFUSED.items() if (a, b) not in NOT_A_COMBINATION]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
