"""zkit plugin entry point of zkit-sequence: the ``ulysses`` attention record, and the engine's
sequence parallelism (``sequence_parallel_size`` > 1) through the hook ``zkit_sequence_parallel``."""
from __future__ import annotations

from typing import Any

import zkit
from zkit.core.records import AttentionRecord
from zkit.host_memory import return_freed_memory

from zkit_sequence import __version__
from zkit_sequence.attention import UlyssesAttention, make_ulysses_attention
from zkit_sequence.binding import bind_model
from zkit_sequence.groups import GROUPS, build_groups


@zkit.hookimpl
def zkit_register_attention():
    yield AttentionRecord(
        name="ulysses",
        factory=make_ulysses_attention,
        description="Ulysses sequence parallelism around another attention record (inner=...): all-to-alls "
                    "swap sequence slices for heads",
    )


@zkit.hookimpl
def zkit_sequence_parallel(module: Any, assembly: Any, stash: Any, config: Any, device: Any, size: int) -> Any:
    """Build the sequence and data-parallel groups, bind the model's sequence-parallel parts, and
    refuse what they cannot run, at initialize."""
    if getattr(module, "data_parallel_group", None) is not None:
        # the engine's protocol for a model split over a grid of its own (zkit-pipeline)
        raise ValueError(
            f"sequence_parallel_size {size} with a model that brings its own data-parallel group "
            f"({type(module).__name__}: zkit-pipeline's pipeline or tensor parallelism) is not supported: sequence "
            f"parallelism splits the whole world into sequence groups; use one or the other"
        )
    groups = build_groups(size, assembly.communicator)
    bind_model(module, groups.comm)
    if not any(isinstance(m, UlyssesAttention) for m in module.modules()):
        raise ValueError(
            f"sequence_parallel_size {size}: the model has no sequence-parallel attention, so each rank would attend "
            f"over its slice of the sequence only; build its attention with "
            f"zkit.core.attention.build_attention('ulysses', inner=..., num_heads=...) (zkit-sequence)"
        )
    stash[GROUPS] = groups
    if activations_in_host_memory(config, device):
        return_freed_memory(because="sequence parallelism with activations in host memory")
    return groups.sequence


def activations_in_host_memory(config: Any, device: Any) -> bool:
    """Whether a step's activations (or their checkpoints) live in host memory: a CPU device, or
    ``activation_checkpointing.cpu_checkpointing``. A long sequence's activations, not the model
    states that zkit's host-memory policy weighs, then fill the rank's memory, as tensors of a few
    MiB made and freed by the hundred each step (all-to-all buffers, the whole sequence's heads,
    tiles, recomputed blocks): under glibc's moving mmap threshold those come from the heap, and
    the heap keeps what they leave. Measured on bench_sequence.py's model (Ulysses 4, tiled MLP and
    loss, 8,192 tokens): a rank's resident set grew 224 MiB over initialize for 35 MiB of live
    tensors; with freed memory returned, 81 MiB."""
    if device.type == "cpu":
        return True
    section = config.section("activation_checkpointing")
    return section is not None and section.cpu_checkpointing


@zkit.hookimpl
def zkit_report():
    yield "zkit-sequence", f"{__version__}: Ulysses attention ('ulysses'), sequence-sharded data, tiled MLP and loss"
