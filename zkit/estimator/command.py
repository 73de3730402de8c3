"""Per-rank memory before a run: model states for every ZeRO stage x offload x dtype x world size,
and the activations of a GPT-shaped model for a batch, with and without checkpointing.

    from zkit.estimator.command import estimate_memory
    with torch.device("meta"):                 # no memory is used to describe the model
        model = GPT(GPTConfig.preset("gpt2-350m"))
    print(estimate_memory(model, batch=8).table())
    estimate_memory(num_params=7_000_000_000, world_sizes=(8, 64)).table()

``zkit estimate`` prints the same table. Model-state figures follow zkit's own layout exactly (see
:mod:`zkit.zero.model_states`); they are checked against ``engine.memory()``.
"""
from __future__ import annotations

import functools
from typing import Any, Iterable, Sequence

import attrs
import torch

from zkit.estimator.activations import gpt_activation_bytes
from zkit.zero import OFFLOADS, STAGES, StateBytes, model_state_bytes
from zkit.core.plugin_manager import get_plugin_manager

DTYPES = ("fp32", "fp16")
#: optimizer name -> bytes of state per parameter element
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "lamb": 8, "lion": 4, "adagrad": 4, "sgd-momentum": 4, "sgd": 0}


@attrs.frozen
class Row:
    world_size: int
    stage: int
    offload: str
    dtype: str
    states: StateBytes


@attrs.frozen
class ActivationRow:
    dtype: str
    checkpointing: bool
    saved: int
    peak: int


@attrs.frozen
class Estimate:
    """What :func:`estimate_memory` found. ``rows``: model states per combination (for the rank
    holding the most); ``activations``: per micro-batch, when the model's shape is known."""

    num_params: int
    rows: tuple[Row, ...]
    activations: tuple[ActivationRow, ...] = ()
    batch: int | None = None
    seq: int | None = None

    def row(self, *, world_size: int, stage: int, offload: str = "none", dtype: str = "fp16") -> Row:
        for r in self.rows:
            if (r.world_size, r.stage, r.offload, r.dtype) == (world_size, stage, offload, dtype):
                return r
        raise KeyError(f"no estimate for world_size={world_size}, stage={stage}, offload={offload!r}, dtype={dtype!r}")

    def table(self) -> str:
        """Fixed-width text, one block per world size (GiB per rank)."""
        lines = [f"zkit memory estimate: {self.num_params:,} parameters (GiB per rank; model states)"]
        for world in sorted({r.world_size for r in self.rows}):
            lines.append("")
            lines.append(f"world size {world}")
            lines.append(f"  {'stage':>5}  {'offload':<10} {'dtype':<9} {'device':>9} {'host':>9} {'nvme':>9}")
            for r in (r for r in self.rows if r.world_size == world):
                label = "fp16/bf16" if r.dtype == "fp16" else r.dtype
                if not r.states.supported:
                    lines.append(f"  {r.stage:>5}  {r.offload:<10} {label:<9} {'n/a (parameter offload needs stage 3)':>29}")
                    continue
                s = r.states
                lines.append(
                    f"  {r.stage:>5}  {r.offload:<10} {label:<9} {_gib(s.device_total):>9} {_gib(s.host_total):>9} {_gib(s.nvme_total):>9}"
                )
        if self.activations:
            lines.append("")
            lines.append(f"activations per micro-batch (batch {self.batch}, seq {self.seq}), GiB per rank")
            lines.append(f"  {'dtype':<9} {'checkpointing':<14} {'saved':>9} {'peak':>9}")
            for a in self.activations:
                label = "fp16/bf16" if a.dtype == "fp16" else a.dtype
                lines.append(f"  {label:<9} {'yes' if a.checkpointing else 'no':<14} {_gib(a.saved):>9} {_gib(a.peak):>9}")
        return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f}"


def _shapes_of(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of the trainable parameters; names carry the module (stage 3's units)."""
    return [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]


def _check_choices(label: str, values: Iterable[Any], valid: Sequence[Any]) -> tuple[Any, ...]:
    values = tuple(values)
    bad = [v for v in values if v not in valid]
    if not values or bad:
        raise ValueError(f"{label} must be chosen from {', '.join(map(str, valid))}; got {', '.join(map(str, bad)) or 'nothing'}")
    return values


@functools.lru_cache(maxsize=None)
def store_align_elems(offload: str) -> int:
    """Where the master store of the allocator that ``offload`` selects starts each unit: the
    installed ``nvme`` allocator record's ``align_elems`` (zkit-offload's: 4 KiB); 1 otherwise."""
    if offload != "nvme":
        return 1
    record = get_plugin_manager().records("allocator").get("nvme")
    return record.align_elems if record is not None else 1


def estimate_memory(
    model: torch.nn.Module | None = None,
    *,
    num_params: int | None = None,
    gpt_config: Any = None,
    world_sizes: Sequence[int] = (1, 2, 4, 8),
    stages: Sequence[int] = STAGES,
    offloads: Sequence[str] = OFFLOADS,
    dtypes: Sequence[str] = DTYPES,
    batch: int | None = None,
    seq: int | None = None,
    optimizer: str = "adam",
    reduce_bucket_size: int = 500_000_000,
    overlap_comm: bool | None = None,
    accelerator: bool = True,
    attention: str = "flash",
    largest_layer: int | None = None,
    stage3_max_reuse_distance: int = 1_000_000_000,
) -> Estimate:
    """Estimate per-rank memory for a model (built on the meta device is enough), a
    :class:`~zkit.models.gpt.GPTConfig`, or a bare parameter count (packed as if into full units).

    Activations are added when the shape is a GPT (``gpt_config``, or a model with a ``config``
    that is one) and ``batch`` is given; ``seq`` defaults to the model's ``seq_len``.
    ``largest_layer`` overrides the largest unit stage 3 gathers at once (default: from the
    model's modules). ``stage3_max_reuse_distance``: the config key of that name (at the default,
    stage 3 keeps a model of fewer elements gathered from forward into backward)."""
    from zkit.models import GPT, GPTConfig

    given = [x is not None for x in (model, num_params, gpt_config)]
    if sum(given) != 1:
        raise ValueError("estimate_memory needs exactly one of model=, num_params= or gpt_config=")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZER_STATE_BYTES)}")
    stages = _check_choices("stages", stages, STAGES)
    offloads = _check_choices("offloads", offloads, OFFLOADS)
    dtypes = _check_choices("dtypes", dtypes, ("fp32", "fp16", "bf16"))
    worlds = tuple(world_sizes)
    if not worlds or any(type(w) is not int or w < 1 for w in worlds):
        raise ValueError(f"world_sizes must be ints >= 1, got {worlds!r}")
    if gpt_config is not None:
        if not isinstance(gpt_config, GPTConfig):
            raise TypeError(f"gpt_config must be a zkit.models.gpt.GPTConfig, got {type(gpt_config).__name__}")
        with torch.device("meta"):
            model = GPT(gpt_config)
    if model is not None:
        shapes = _shapes_of(model)
        config = getattr(model, "config", None)
        gpt = config if isinstance(config, GPTConfig) else None
    else:
        if type(num_params) is not int or num_params < 1:
            raise ValueError(f"num_params must be an int >= 1, got {num_params!r}")
        bucket = max(int(reduce_bucket_size), 1)
        # one block (and module) per chunk, so stage 3 sees reduce_bucket_size-sized units too
        shapes = [(f"chunks.{i}.weight", (min(bucket, num_params - start),)) for i, start in enumerate(range(0, num_params, bucket))]
        gpt = None
    total = sum(int(torch.Size(s).numel()) for _, s in shapes)
    if total == 0:
        raise ValueError("the model has no trainable parameters (requires_grad=True)")
    rows = []
    for world in worlds:
        for stage in stages:
            for offload in offloads:
                for dtype in dtypes:
                    states = model_state_bytes(
                        shapes, stage=stage, world_size=world, dtype=dtype, offload=offload,
                        reduce_bucket_size=reduce_bucket_size, overlap_comm=overlap_comm,
                        optimizer_state_bytes=OPTIMIZER_STATE_BYTES[optimizer], accelerator=accelerator,
                        largest_layer=largest_layer, stage3_max_reuse_distance=stage3_max_reuse_distance,
                        align_elems=store_align_elems(offload),
                    )
                    rows.append(Row(world, stage, offload, dtype, states))
    acts: list[ActivationRow] = []
    if gpt is not None and batch is not None:
        seq = gpt.seq_len if seq is None else seq
        for dtype in dtypes:
            for ckpt in (False, True):
                a = gpt_activation_bytes(
                    gpt, batch, seq, dtype_bytes=4 if dtype == "fp32" else 2, checkpointing=ckpt, attention=attention
                )
                acts.append(ActivationRow(dtype, ckpt, a["saved"], a["peak"]))
    return Estimate(total, tuple(rows), tuple(acts), batch if acts else None, seq if acts else None)
