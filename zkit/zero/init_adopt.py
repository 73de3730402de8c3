"""What ``initialize`` does with a model built under :class:`zkit.zero.Init`.

Init partitions each module's parameters as the module is built, one unit per module, before user
code has finished with the model: it may still set a parameter to ``None``, replace one, or freeze
some (BitFit, LoRA-style partial freezing). Stage 3 partitions a module's *trainable* parameters
(:func:`stage3_groups`) and keeps frozen ones whole, like the same model built without Init. So a
unit Init made is kept only if stage 3 trains all of its parameters (stage 3 then forms its own
units of them, gathering one block's Init units at a time); every other unit is gathered and its
parameters become whole ordinary parameters again, which the partitioner then treats as it would a
model built whole (re-partitioning the trainable ones from their real values). At stages
0-2, and with a partitioner of no ZeRO stage, every unit is gathered: those keep whole parameters
on every rank anyway (DeepSpeed fails there at the first forward).

Gathering is a collective: every rank walks the same model in the same order. A model split into
pipeline stages breaks that (each stage holds only its own layers' units), so it is refused, on
every rank. Init keeps tensor-parallel slices out of its units, and a unit is kept only if it is
partitioned over the partitioner's own ranks (Init uses the world; a tensor-parallel model's
data-parallel group is smaller).
"""
from __future__ import annotations

import logging
from collections import Counter

import torch

from zkit.core import distributed
from zkit.core.model_parts import model_part, pipeline_under_init_refusal
from zkit.zero.sharded_params import ShardedUnit, ZeroParameter

log = logging.getLogger("zkit")


#: the values of ``zero_optimization.stage3_gather_unit``
GATHER_UNITS = ("block", "module")


def stage3_groups(module: torch.nn.Module, unit: str = "module") -> list[tuple[str, list[tuple[str, torch.nn.Parameter]]]]:
    """Stage 3's parameter groups, in module order, each ``(module name, [(name, parameter)])``
    with the parameters named from the root and only trainable ones, a parameter reachable from
    several modules in the first of them only.

    ``unit="module"`` (DeepSpeed's): each module's own parameters. ``unit="block"`` (FSDP2's
    per-block wrap): every parameter under a block (:func:`blocks`) is in that block's group, every
    other one in the root's (named ``""``, placed where its first parameter is)."""
    if unit not in GATHER_UNITS:
        raise ValueError(f"stage-3 gather unit {unit!r}: expected one of {', '.join(GATHER_UNITS)}")
    owner = {}
    if unit == "block":
        for name, block in blocks(module):
            for sub, _ in block.named_modules(prefix=name):
                owner[sub] = name
    seen: set[int] = set()
    groups: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for mname, m in module.named_modules():
        own = [
            (f"{mname}.{n}" if mname else n, p)
            for n, p in m.named_parameters(recurse=False)
            if p.requires_grad and id(p) not in seen
        ]
        seen.update(id(p) for _, p in own)
        if own:
            key = mname if unit == "module" else owner.get(mname, "")
            groups.setdefault(key, []).extend(own)
    return list(groups.items())


def blocks(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's blocks, in module order: the children of a ``ModuleList`` or ``Sequential`` of
    which the container holds at least two of the same class (a transformer's layers), outermost
    first (a block inside a block is part of it)."""
    found: list[tuple[str, torch.nn.Module]] = []
    inside: set[int] = set()
    for mname, m in module.named_modules():
        if id(m) in inside or not isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        kinds = Counter(type(c) for c in m.children())
        for cname, child in m.named_children():
            if kinds[type(child)] >= 2 and id(child) not in inside:
                found.append((f"{mname}.{cname}" if mname else cname, child))
                inside.update(id(s) for s in child.modules())
    return found


def adopt_init_model(module: torch.nn.Module, stage: int | None, world_size: int) -> int:
    """Gather every Init unit of ``module`` that a partitioner of ZeRO ``stage`` over
    ``world_size`` ranks would not keep as it is; returns how many parameters became whole."""
    units = _init_units(module)
    _refuse_pipeline_stages(module, units)
    if not units:
        return 0
    kept: set[int] = set()
    if stage == 3:
        # Stage 3 takes over a unit whose parameters it trains, whatever units it forms of them
        # (per block, it gathers the units of one block at a time into the block's own units).
        trainable = {id(p) for _, own in stage3_groups(module) for _, p in own}
        for su in units:
            # Init's world, not the partitioner's data-parallel group (tensor parallelism)
            if su.comm.world_size == world_size and all(id(p) in trainable for p in su.params):
                kept.add(id(su))
    whole = 0
    for su in units:
        if id(su) not in kept:
            whole += _gather_whole(su)
    if whole:  # memory the user may not expect: say so once
        why = ("modules whose parameters changed after they were built (frozen, removed, replaced)"
               if stage == 3 else f"ZeRO stage {stage}, which holds whole parameters on every rank"
               if stage is not None else "a partitioner that does not partition parameters")
        log.info("zkit.zero.Init: %d parameters gathered whole for %s", whole, why)
    return whole


def _refuse_pipeline_stages(module: torch.nn.Module, units: list[ShardedUnit]) -> None:
    """Refuse a pipeline built under Init: Init partitioned every layer over the whole world, and
    each stage now holds only its own layers, so the stages' gathers would not match. The ranks
    first agree whether any of them holds a unit: one refusing alone would leave the others
    waiting in a collective."""
    part = model_part(module)
    stages = int(part[1].get("pipe", 1)) if part is not None else 1
    if stages <= 1:
        return
    held = torch.tensor([1.0 if units else 0.0], device=distributed.default_device())
    torch.distributed.all_reduce(held, op=torch.distributed.ReduceOp.MAX)
    if held.item():
        raise ValueError(pipeline_under_init_refusal(stages))


def _init_units(module: torch.nn.Module) -> list[ShardedUnit]:
    """The units of the module's partitioned parameters, each once, in parameter order (the same
    on every rank: the gathers that follow must match)."""
    units: dict[int, ShardedUnit] = {}
    for p in module.parameters():
        su = getattr(p, "_zkit_unit", None) if isinstance(p, ZeroParameter) else None
        if su is not None:
            units.setdefault(id(su), su)
    return list(units.values())


def _gather_whole(su: ShardedUnit) -> int:
    """Gather ``su`` and turn its parameters (also those no module holds any more) back into
    ordinary parameters holding their full values; the unit is dropped."""
    if su.store.shards_leave_memory:  # out of Init's shard store (NVMe): its file goes with it
        su.shard_to_memory()
    su.wait()
    with torch.no_grad():
        values = [su.full[s.offset : s.offset + s.numel].view(s.shape).clone() for s in su.unit.slots]
    su.release(force=True)
    for p, value in zip(su.params, values):
        p.__class__ = torch.nn.Parameter
        for attr in ("_zkit_unit", "_zkit_released", "_zkit_id"):
            p.__dict__.pop(attr, None)
        p.data = value
    return len(values)
