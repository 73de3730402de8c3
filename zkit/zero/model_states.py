"""Model-state bytes per rank from zkit's own layout (:mod:`zkit.zero.flat`), not from rules of thumb.

For stages 0-2 every figure is the byte count the partitioners allocate (``zkit/zero/``), purpose
by purpose, so it equals ``engine.memory()``:

* ``param``: every unit's padded flat buffer in the training dtype (stage 0 plans units for one
  rank: no padding);
* ``master``: the fp32 copy of the rank's shard of every unit, absent when training in fp32 with
  the master on the training device (the parameters *are* the master);
* ``grad``: stages 0-1 a full flat gradient buffer per unit in the training dtype (stage 1
  reduce-scatters into the rank's own slice of it, in place); stage 2 only the shard
  (communication dtype);
* ``bucket`` (stage 2): ``min(units, 2 if overlap_comm else 1)`` buckets of the largest unit
  (communication dtype; later micro-steps reduce in place into the bucket's own chunk); at one
  replica none, and ``grad`` is in the training dtype: the shards are the parameters' gradients,
  written in place (unless the optimizer is offloaded from an accelerator or to NVMe);
* ``optim_state``: the optimizer's per-element state over the *real* elements the rank owns
  (padding has no optimizer parameter).

Offload (zkit-offload's ``host`` / ``nvme`` allocators) moves ``master`` and ``optim_state`` to
the host and adds the fp32 gradient copy the host optimizer reads; at stages 2-3 the reduced chunks
are copied straight into that copy, so no gradient shard stays on the device (with gradient
accumulation the host also holds a staging copy of the same size while a batch runs). ``nvme`` at stage 1 puts the
state on disk with ``buffer_count`` sub-group buffer sets on the host; at stages 2-3 the fp32
master and its gradients go to disk too (laid out in sub-groups by :func:`zkit.zero.flat.pack_aligned`,
units on the ``align_elems`` boundaries of the ``nvme`` allocator record: 4 KiB), no gradient shard stays in memory, and the host holds two gradient
staging buffers of the largest unit (``master_grad``) and the sub-group buffer sets (master,
gradient and state: ``optim_state``). Parameter offload exists at stage 3 only.

Stage 3 follows :class:`zkit.zero.stage3.Stage3` (:func:`stage3_plan`): with
``stage3_gather_unit="block"`` one unit per block (a parameter's block is the first index in its
name, ``layers.3`` of ``layers.3.mlp.weight``, where two or more indices share the prefix: the
children of a ``ModuleList`` or ``Sequential``) and one for the root's other parameters, each
parameter of at most ``stage3_param_persistence_threshold`` elements in a persistent unit of its
own block's; with ``"module"`` one unit per module's own parameters (:func:`stage3_units`; a
parameter's module is its name up to the last dot). Units are padded to the world size; ``param``
is every unit's shard in the training dtype plus the full buffer of each *persistent* unit (per
block: its small parameters; per module: a unit of ``numel <= stage3_param_persistence_threshold``;
while the persistent total stays within ``stage3_model_persistence_threshold``: gathered once, kept);
``grad`` the gradient shards; ``bucket``, ``master`` and ``optim_state`` as at stage 2, over
those units. ``gathered_param`` is the working set of forward and backward: the largest released
unit plus a prefetch bucket of released units (``stage3_prefetch_bucket_size``), plus the units kept
gathered for a reuse within ``stage3_max_reuse_distance`` elements (when it is not 0: one more
largest unit and the distance), capped at all released units. With one replica and the shards on
the training device, a shard is its unit's gathered buffer: neither the persistent full buffers nor
``gathered_param`` take memory of their own.

Purposes in :data:`TRANSIENT` exist only while a batch runs: gradients and buckets are made by the
batch's first backward and handed back after the step (no stage holds gradient memory between
steps, as with DeepSpeed), and stage 3 gathers parameters only in forward and backward. The other
purposes are what ``engine.memory()`` reports between steps; all of them together are the peak.
"""
from __future__ import annotations

import sys
from typing import Iterable, Sequence

import attrs

from zkit.zero.flat import Unit, pack_aligned, persistent_units, plan_units


#: purposes held only while a batch runs (not between steps)
TRANSIENT = ("grad", "bucket", "gathered_param")

STAGES = (0, 1, 2, 3)
OFFLOADS = ("none", "cpu", "cpu+params", "nvme")
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@attrs.frozen
class StateBytes:
    """Bytes by purpose on the training device, in host memory and on NVMe, for one rank.
    ``supported`` is False for combinations zkit refuses (parameter offload below stage 3)."""

    device: dict[str, int]
    host: dict[str, int]
    nvme: dict[str, int]
    supported: bool = True

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def device_between_steps(self) -> dict[str, int]:
        """What the training device holds between steps (no :data:`TRANSIENT` purpose)."""
        return {k: v for k, v in self.device.items() if k not in TRANSIENT}

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def nvme_total(self) -> int:
        return sum(self.nvme.values())


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}") from None


def plan(shapes: Sequence[tuple[str, tuple[int, ...]]], unit_numel: int, world_size: int) -> list[Unit]:
    """Units exactly as the partitioners plan them: parameters in reverse registration order."""
    return plan_units(reversed(list(shapes)), max(int(unit_numel), 1), world_size)


def stage3_units(shapes: Sequence[tuple[str, tuple[int, ...]]], world_size: int) -> list[Unit]:
    """Units exactly as ZeRO stage 3 plans them per module (``stage3_gather_unit: "module"``): one per module's own parameters (``shapes`` in
    registration order, so a module's parameters are consecutive), modules in reverse order."""
    by_module: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape in shapes:
        by_module.setdefault(name.rpartition(".")[0], []).append((name, shape))
    units = []
    for index, params in enumerate(reversed(list(by_module.values()))):
        (unit,) = plan_units(params, 1 << 62, world_size)  # one unit whatever its size
        units.append(attrs.evolve(unit, index=index))
    return units


def stage3_plan(shapes: Sequence[tuple[str, tuple[int, ...]]], world_size: int, unit: str = "block",
                param_threshold: int = 100_000, model_threshold: int = sys.maxsize) -> list[tuple[Unit, bool]]:
    """Stage 3's units and whether each is persistent, as :class:`zkit.zero.stage3.Stage3` plans
    them (``shapes`` in registration order; see the module docstring for ``unit``)."""
    if unit == "module":
        units = stage3_units(shapes, world_size)
        return list(zip(units, persistent_units([u.numel for u in units], param_threshold, model_threshold)))
    names = [name for name, _ in shapes]
    children: dict[str, set[str]] = {}
    for name in names:
        parts = name.split(".")[:-1]
        for i, part in enumerate(parts):
            if part.isdigit():
                children.setdefault(".".join(parts[:i]), set()).add(part)

    def block(name: str) -> str:
        parts = name.split(".")[:-1]
        for i, part in enumerate(parts):
            if part.isdigit() and len(children[".".join(parts[:i])]) >= 2:
                return ".".join(parts[: i + 1])
        return ""

    groups: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for item in shapes:
        groups.setdefault(block(item[0]), []).append(item)
    grouped = [item for members in groups.values() for item in members]
    keep = dict(zip([name for name, _ in grouped],
                    persistent_units([_numel(shape) for _, shape in grouped], param_threshold, model_threshold)))
    planned = [([item for item in members if keep[item[0]] is persistent], persistent)
               for members in groups.values() for persistent in (False, True)]
    planned = [(params, persistent) for params, persistent in reversed(planned) if params]
    out = []
    for index, (params, persistent) in enumerate(planned):
        (u,) = plan_units(params, 1 << 62, world_size)
        out.append((attrs.evolve(u, index=index), persistent))
    return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _owned_real(units: Iterable[Unit], rank: int) -> int:
    return sum(p.numel for u in units for p in u.pieces(rank))


def model_state_bytes(
    shapes: Sequence[tuple[str, tuple[int, ...]]],
    *,
    stage: int,
    world_size: int,
    dtype: str = "fp16",
    offload: str = "none",
    rank: int = 0,
    reduce_bucket_size: int = 500_000_000,
    overlap_comm: bool | None = None,
    communication_dtype: str | None = None,
    optimizer_state_bytes: int = 8,
    accelerator: bool = True,
    largest_layer: int | None = None,
    stage3_prefetch_bucket_size: int = 50_000_000,
    stage3_param_persistence_threshold: int = 100_000,
    stage3_model_persistence_threshold: int = sys.maxsize,
    stage3_max_reuse_distance: int = 1_000_000_000,
    stage3_gather_unit: str | None = None,
    sub_group_size: int = 1_000_000_000,
    buffer_count: int = 4,
    align_elems: int = 1,
) -> StateBytes:
    """Per-purpose bytes of one rank. ``shapes``: ``(name, shape)`` of the trainable parameters in
    registration order (a tied parameter once). ``optimizer_state_bytes``: state bytes per
    element (Adam/AdamW 8, SGD with momentum, Adagrad, Lion 4, SGD 0). ``accelerator=False``:
    training on the CPU, where host and device are one memory (the fp32 master is then the
    parameters even with offload). Stage 3 only: ``largest_layer`` overrides the largest released
    unit in ``gathered_param`` (default: from the shapes); the ``stage3_*`` arguments are the
    config keys of the same names (``stage3_gather_unit`` by default as in the config). ``align_elems``: the ``nvme`` allocator record's field of that
    name, where its master store starts each unit (:mod:`zkit.estimator.command` passes the installed
    record's)."""
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of 0, 1, 2, 3, got {stage!r}")
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {', '.join(OFFLOADS)}, got {offload!r}")
    if type(world_size) is not int or world_size < 1:
        raise ValueError(f"world size must be an int >= 1, got {world_size!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world size {world_size}")
    p = dtype_bytes(dtype)
    c = dtype_bytes(communication_dtype) if communication_dtype else p
    if overlap_comm is None:
        overlap_comm = stage == 3
    if offload == "cpu+params" and stage < 3:
        return StateBytes({}, {}, {}, supported=False)
    world = 1 if stage == 0 else world_size
    rank = 0 if stage == 0 else rank
    if stage == 3:
        if stage3_gather_unit is None:  # the config's default: per module only with parameters on NVMe
            stage3_gather_unit = "block"
        planned = stage3_plan(shapes, world, stage3_gather_unit, int(stage3_param_persistence_threshold),
                              int(stage3_model_persistence_threshold))
        units, keep = [u for u, _ in planned], [k for _, k in planned]
    else:
        units = plan(shapes, reduce_bucket_size, world)
    padded = sum(u.padded for u in units)
    shard = sum(u.shard for u in units)
    owned = _owned_real(units, rank)
    device: dict[str, int] = {}
    host: dict[str, int] = {}
    nvme: dict[str, int] = {}
    offloaded = offload != "none"
    states_side = host if offloaded and accelerator else device
    # fp32 with the master on the training device: no separate copy (ZeroPartitioner._build_master).
    master_is_param = dtype == "fp32" and not (offloaded and accelerator)

    if stage < 3:
        device["param"] = padded * p
        # stages 0-1: full per-unit buffers (stage 1 reduce-scatters in place); stage 2: shards
        device["grad"] = shard * c if stage == 2 else padded * p
    else:
        persistent = [u for u, k in zip(units, keep) if k]
        released = [u.padded for u, k in zip(units, keep) if not k]
        params_side = host if offload == "cpu+params" and accelerator else device
        # one replica with the shards where they are computed with: a shard is its unit's gathered
        # buffer (zkit.zero.sharded_params), nothing is gathered beside it
        in_place = world == 1 and params_side is device
        params_side["param"] = (shard + (0 if in_place else sum(u.padded for u in persistent))) * p
        device["grad"] = shard * c
        if released and not in_place:
            largest = max(released) if largest_layer is None else int(largest_layer)
            # zkit.zero.reuse: the units kept for a reuse within the distance (at 0 only a unit used
            # again next, already counted as the one in use)
            reuse = int(stage3_max_reuse_distance)
            kept = largest + reuse if reuse > 0 else 0
            gathered = min(sum(released), largest + int(stage3_prefetch_bucket_size) + kept)
            device["gathered_param"] = gathered * p
    # stages 2-3 at one replica (zkit.zero.grad_sinks.GradViews): the shards are the parameters'
    # gradients, written in place in the training dtype; nothing is reduced, so no bucket
    grads_in_place = stage >= 2 and world == 1 and offload != "nvme" and not (offloaded and accelerator)
    if grads_in_place:
        device["grad"] = shard * p
    elif stage >= 2:
        # reduce-scatter buckets, each the largest unit
        buckets = min(len(units), 2 if overlap_comm else 1)
        device["bucket"] = buckets * max(u.padded for u in units) * c
    if offload == "nvme" and stage >= 2:
        # zkit-offload's master store: master, gradients and state in sub-group swap files
        del device["grad"]
        align = max(int(align_elems), 1)
        _, groups = pack_aligned([u.shard for u in units], align, max(int(sub_group_size), 1))
        on_host = host if accelerator else device
        nvme.update(master=sum(groups) * 4, master_grad=sum(groups) * 4, optim_state=sum(groups) * optimizer_state_bytes)
        on_host["master_grad"] = 2 * -(-max(u.shard for u in units) // align) * align * 4
        on_host["optim_state"] = max(2, buffer_count) * max(groups) * (8 + optimizer_state_bytes)
        return StateBytes(drop_zero(device), drop_zero(host), drop_zero(nvme))
    if not master_is_param:
        states_side["master"] = shard * 4
    if offloaded and accelerator:
        host["master_grad"] = shard * 4  # the fp32 gradient the host optimizer steps with
        if stage >= 2:
            # stages 2-3 copy each reduced chunk straight into it (Allocator.grads_beside_master):
            # no gradient shard on the device
            del device["grad"]
    state = owned * optimizer_state_bytes
    if offload == "nvme":  # stage 1: only the state on disk
        nvme["optim_state"] = state
        per_set = min(sub_group_size, owned) * optimizer_state_bytes
        (host if accelerator else device)["optim_state"] = max(2, buffer_count) * per_set
    else:
        states_side["optim_state"] = state
    return StateBytes(drop_zero(device), drop_zero(host), drop_zero(nvme))


def drop_zero(d: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in d.items() if v}
