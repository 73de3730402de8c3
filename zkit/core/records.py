"""The small typed records that registration hooks yield.

Every family of plugins (partitioner, communicator, optimizer, scheduler, allocator, attention)
registers *records*: frozen attrs classes holding a name, a factory and what the engine must know
about the thing before building it. The config or a :class:`zkit.Stack` picks a record by name.
Checkpoint formats (:class:`CheckpointFormatRecord`) are records too, picked by which one
recognises a directory.

A plugin never fills in ``dist``: the plugin manager stamps each record with the distribution that
registered it, so that a duplicate name can be reported naming both distributions.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, ClassVar, Literal

import attrs

from zkit.core.checkpoint_errors import CheckpointError


def _name(value: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"a record name must be a non-empty string, got {value!r}")
    return value.strip().lower()


def _names(values) -> tuple[str, ...]:
    return tuple(_name(v) for v in values)


@attrs.frozen(kw_only=True)
class Record:
    """Fields shared by every record. Names are case-insensitive (stored lower-case), so the
    DeepSpeed spellings ``"Adam"``, ``"adam"`` and ``"ADAM"`` all select the same record."""

    name: str = attrs.field(converter=_name)
    factory: Callable[..., Any]
    description: str = ""
    aliases: tuple[str, ...] = attrs.field(default=(), converter=_names)
    #: set by the plugin manager: the distribution (or ``"zkit"``) that registered the record.
    dist: str = ""

    @property
    def family(self) -> str:
        return FAMILY_OF_RECORD[type(self)]


@attrs.frozen(kw_only=True)
class PartitionerRecord(Record):
    """How model states are split across data-parallel ranks.

    ``factory(ctx: zkit.core.partitioner.PartitionContext) -> zkit.core.partitioner.Partitioner``.
    ``stage`` is the ZeRO stage the partitioner implements (``zero_optimization.stage`` selects
    by it), or ``None`` for a partitioner selected only by name.
    ``compile_refusal``: why the partitioner cannot train a ``torch.compile``-d module, or ``None``
    when it can; ``engine.compile()`` and ``initialize(model=torch.compile(...))`` raise it, naming
    the record (ZeRO-3's: its gathered parameters make Dynamo recompile the forward at every step).
    """

    stage: int | None = None
    compile_refusal: str | None = None


@attrs.frozen(kw_only=True)
class CommunicatorRecord(Record):
    """Collectives between ranks.

    ``factory(group, config) -> zkit.core.communicator.Communicator`` where ``group`` is a
    ``torch.distributed`` process group (``None`` = the default group). The engine's
    :class:`~zkit.core.assembly.Assembly` calls it, once per group.

    ``wraps``: the name of a communicator record this one sends through (a compressing
    communicator over torch's collectives); the assembly builds that one over the same group
    and calls ``factory(group, config, transport=...)``. Such a communicator carries the
    data-parallel gradient exchange only; every other process group gets the one it wraps.
    """

    wraps: str | None = None


@attrs.frozen(kw_only=True)
class OptimizerRecord(Record):
    """An optimizer the config can name (``"optimizer": {"type": name, "params": {...}}``).

    ``factory(param_groups, **params) -> torch.optim.Optimizer``; ``param_groups`` is a list of
    dicts in torch's format. The partitioner hands the optimizer *its own shard* of every parameter,
    so the record must say what the optimizer keeps per parameter:

    * ``state_names``: the per-parameter state tensors shaped like the parameter that the optimizer
      *may* keep (Adam: ``("exp_avg", "exp_avg_sq", "max_exp_avg_sq")``); any may be absent (before
      the first step, or when an option is off). Checkpoints reshard these element by element.
    * ``elementwise``: True when the update of each element depends only on that element (Adam,
      SGD). A non-elementwise optimizer (LAMB's trust ratio needs whole-parameter norms) steps on
      shards only if it defines the shard-norm protocol below; otherwise a partitioner that shards
      states over more than one rank refuses it with a clear error.

    Shard-norm protocol. A non-elementwise optimizer may define
    ``set_shard_norms(param_index: list[int], num_params: int, all_reduce: Callable[[Tensor], None])``,
    which the partitioner calls once, right after building it over shards:

    * ``param_index[i]`` is the model parameter (``0 .. num_params - 1``, numbered identically on
      every rank) that the optimizer's ``i``-th parameter, counted over ``param_groups`` in order,
      is a piece of. A rank owning nothing holds one empty placeholder that never has a gradient.
    * ``all_reduce(t)`` sums ``t`` in place over the data-parallel ranks.
    * From then on, ``step()`` computes each per-parameter norm as per-piece partial sums of squares
      scatter-added (``index_add``) into one ``[k, num_params]`` tensor (``k`` norms per parameter:
      2 for LAMB, weight and update), all-reduces it once, takes the square root and reads each
      piece's whole-parameter norms back. Pieces of one parameter on one rank add up; a rank
      without a piece contributes zeros.
    * Every rank calls ``step()`` every step, and the optimizer issues the same collectives in the
      same order on every rank, whatever it holds (no early return before the all-reduce).
    * ``devices``: device types the optimizer can step on (``"cpu"``, ``"cuda"``).
    * ``state_format``: what the saved per-parameter state means. A checkpoint's optimizer state
      loads into an optimizer of the same format only (torch's Adam and AdamW and zkit-offload's
      CPU Adams share ``"adam"``: moments with Adam's meaning); ``None`` means this record's own
      name. 1-bit Adam's frozen variance is not Adam's second moment, so it has its own format.
    * ``communicator``: the communicator record the optimizer exchanges through (1-bit Adam's
      ``"onebit"``), chosen for it unless the user's stack names one.
    * ``needs_communicator``: the factory takes ``comm=``, the engine's data-parallel
      communicator (the one the partitioner reduces gradients through), for collectives the
      optimizer issues itself (1-bit Adam's compressed momenta).
    """

    state_names: tuple[str, ...] = ()
    elementwise: bool = True
    devices: tuple[str, ...] = ("cpu", "cuda")
    state_format: str | None = None
    communicator: str | None = None
    needs_communicator: bool = False

    @property
    def saved_state_format(self) -> str:
        """The format checkpoints record: ``state_format``, else the record's name."""
        return self.state_format or self.name


@attrs.frozen(kw_only=True)
class SchedulerRecord(Record):
    """Something that orders training over time.

    * ``kind="lr"``: a learning-rate schedule; ``factory(optimizer, **params)`` returns an object
      with ``step()``, ``get_last_lr()``, ``state_dict()`` and ``load_state_dict()``. Selected by
      ``"scheduler": {"type": name, "params": {...}}``.
    * ``kind="step"``: a step schedule, i.e. an instruction stream for one global batch (gradient
      accumulation, GPipe, 1F1B, ...); ``factory(**params)`` returns an object documented by the
      plugin that executes it (see zkit-pipeline).
    """

    kind: Literal["lr", "step"] = attrs.field(
        default="lr", validator=attrs.validators.in_(("lr", "step"))
    )


@attrs.frozen(kw_only=True)
class AllocatorRecord(Record):
    """Where tensors live: device memory, pinned host pools, NVMe files.

    ``factory(device: torch.device, config) -> zkit.core.allocator.Allocator``.

    ``align_elems``: fp32 elements per alignment block at which the allocator's master store
    (:meth:`zkit.core.allocator.Allocator.master_store`) starts every unit's shard (zkit-offload's ``nvme``:
    1024, 4 KiB for direct I/O); 1 where units are packed back to back. The memory estimator
    (:mod:`zkit.estimator`) lays units out by it.
    """

    align_elems: int = attrs.field(default=1, validator=attrs.validators.ge(1))


@attrs.frozen(kw_only=True)
class AttentionRecord(Record):
    """An attention implementation a model can select by name.

    ``factory(**kwargs) -> torch.nn.Module`` called as
    ``module(query, key, value, key_padding_mask=None, attn_mask=None)`` on
    ``[batch, heads, seq, head_dim]`` tensors.
    """


@attrs.frozen(kw_only=True)
class ConfigSectionRecord:
    """A config section (or sub-key) that a plugin owns.

    ``path`` is the dotted key (``"sparse_attention"``, ``"zero_optimization.offload_optimizer"``),
    ``schema`` an attrs class the section's dict is structured into (unknown keys are rejected with
    the closest valid key, like any built-in section). ``default_when_absent``: a config the user
    gives without the section holds the schema's defaults (as for ``zero_optimization``, which every
    run reads) instead of nothing.
    """

    path: str
    schema: type
    description: str = ""
    dist: str = ""
    default_when_absent: bool = False


def _absent(value: Any) -> bool:
    return value is None


@attrs.frozen(kw_only=True)
class ProviderRecord:
    """Which distribution provides a name, so that asking for the name without that distribution
    installed is an error saying what to install. The kernel keeps no such list: installed
    distributions yield these records (zkit's own ``zkit.distributions`` for the distributions
    zkit ships apart), since one that is not installed can say nothing.

    ``kind`` is a record family (``"optimizer"``, ``"allocator"``...), ``"config"`` (``name`` is a
    dotted config key) or ``"hook"`` (``name`` is a hook whose answer the distribution gives).
    ``provider`` is the distribution to install. ``inert(value)``, for config keys: the value asks
    for nothing (``null``; an offload ``device`` of ``"none"``) and is fine without the
    distribution.
    """

    kind: str
    name: str
    provider: str
    inert: Callable[[Any], bool] = _absent
    #: set by the plugin manager: the distribution (or ``"zkit"``) that declared the record.
    dist: str = ""

    def install(self) -> str:
        """What the user runs: ``pip install <provider>``."""
        return f"pip install {self.provider}"


@attrs.frozen(kw_only=True)
class CheckpointFormatRecord:
    """A checkpoint format: how to recognise a directory holding one, and what zkit can do with it.

    ``detect(path, tag) -> bool``: whether ``engine.load_checkpoint(path, tag)`` would find a
    checkpoint of this format (``tag=None``: the tag the directory's ``latest`` file names, or the
    directory itself for a format without tags). ``detect(dir.parent, dir.name)`` asks whether
    ``dir`` is one tag's directory. It must not raise for a directory of another format.

    The operations; a format leaves out what it cannot do (``None``), and asking for it is an error
    naming the format:

    * ``load(engine, path, tag, *, load_optimizer_states, load_lr_scheduler_states)
      -> (loaded path, client_state)``: fill the engine's pieces at any world size and stage.
    * ``save(engine, save_dir, *, tag, client_state, save_latest, exclude_frozen_parameters)
      -> tag``: write the engine's state (``engine.save_checkpoint`` uses the ``"zkit"`` format).

    ``load`` and ``save`` run on every rank and must reach the same verdict on every rank: a
    failure on one rank (a damaged file only it reads, a file-system error on the rank that writes)
    raised on all, before any rank waits in a collective for it, and a refused load leaving every
    rank's state unchanged (:mod:`zkit.core.verdicts`; zkit's formats stage what they read with
    :func:`zkit.checkpoint.fill.fill_pieces`).
    * ``pieces(where) -> zkit.checkpoint.piece_source.PieceSource``: one tag's directory as zkit's
      pieces and index, which ``zkit consolidate`` and the exports read, streaming.
    * ``export(checkpoint_dir, out, *, tag, dtype, **options) -> summary``: write any readable
      checkpoint in this format (``zkit consolidate --format NAME``); the summary's ``summary()``
      is the line the command prints.
    """

    name: str = attrs.field(converter=_name)
    detect: Callable[[Path, "str | None"], bool]
    load: Callable[..., tuple[Any, Any]] | None = None
    save: Callable[..., str] | None = None
    pieces: Callable[[Path], Any] | None = None
    export: Callable[..., Any] | None = None
    description: str = ""
    #: set by the plugin manager: the distribution (or ``"zkit"``) that registered the record.
    dist: str = ""

    #: the operations a format may provide, in the order ``zkit plugins`` lists them
    OPERATIONS: ClassVar[tuple[str, ...]] = ("load", "save", "pieces", "export")

    def provides(self) -> tuple[str, ...]:
        return tuple(op for op in self.OPERATIONS if getattr(self, op) is not None)

    def operation(self, op: str) -> Callable[..., Any]:
        """The operation ``op``, refused naming the format when it does not provide it."""
        if op not in self.OPERATIONS:
            raise ValueError(f"checkpoint formats have no operation {op!r}; operations: {', '.join(self.OPERATIONS)}")
        fn = getattr(self, op)
        if fn is None:
            raise CheckpointError(
                f"the checkpoint format {self.name!r} (from {self.dist or '?'}) does not provide {op!r}; it "
                f"provides: {', '.join(self.provides()) or 'nothing'}"
            )
        return fn


FAMILIES: tuple[str, ...] = (
    "partitioner",
    "communicator",
    "optimizer",
    "scheduler",
    "allocator",
    "attention",
)

RECORD_OF_FAMILY: dict[str, type[Record]] = {
    "partitioner": PartitionerRecord,
    "communicator": CommunicatorRecord,
    "optimizer": OptimizerRecord,
    "scheduler": SchedulerRecord,
    "allocator": AllocatorRecord,
    "attention": AttentionRecord,
}
FAMILY_OF_RECORD: dict[type, str] = {v: k for k, v in RECORD_OF_FAMILY.items()}
