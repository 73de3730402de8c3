"""``engine.offload_states()`` / ``engine.reload_states()``: move an engine's training states off
its device between phases and back (DeepSpeed's calls, as RLHF loops use them: the policy's
optimizer state leaves the GPU while another model generates). The engine reaches this through
its partitioner (:meth:`zkit.core.partitioner.Partitioner.offload_states`), since what moves is
the ZeRO partitioner's state.

What moves is storage, not tensor objects: each state's tensors are reduced to the storages they
view, each storage's bytes are copied into a host buffer and the storage is resized to zero bytes,
which hands its device memory back (on a GPU, to the caching allocator; :func:`offload_states` then
empties the cache as DeepSpeed does). Every view of it - the optimizer's parameters over the fp32
master, the model's parameters over their flat buffer, a tensor a plugin holds - stays the same
object with the same offsets, so :func:`reload_states` only resizes the storages back and copies
the bytes in: nothing is rebuilt or relinked, and training continues bit for bit. Between the two,
using a moved tensor fails loudly (its storage is empty) rather than reading stale values.

The state kinds are DeepSpeed's (:class:`OffloadStateTypeEnum`): ``optim_states`` (the
optimizer's state), ``hp_params`` (the fp32 master), ``lp_params`` (the model's parameters and,
at stage 3, their shards), ``lp_grads`` (gradients still held) and ``contiguous_grad_buffer``
(reduction scratch). zkit hands gradients and scratch back after each step, so between phases
the last two usually hold nothing. With ``offload_optimizer`` the master and the optimizer state
already live on the host and are left where they are (and at stage 3 the gradients too), as in
DeepSpeed. Where the fp32 master *is* the parameters' buffer (fp32 training with the master on
the device), ``hp_params`` and ``lp_params`` are the same bytes: they move together, counted once.
"""
from __future__ import annotations

import enum
import gc
import logging
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import attrs
import torch

from zkit.zero.config import zero_config

if TYPE_CHECKING:  # pragma: no cover
    from zkit.zero.zero_partitioner import ZeroPartitioner

log = logging.getLogger("zkit")


class OffloadDeviceEnum(str, enum.Enum):
    """Where states may be offloaded (DeepSpeed's enum; only ``cpu`` moves anything)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, enum.Enum):
    """The kinds of state :func:`offload_states` moves (DeepSpeed's enum)."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


@attrs.define
class MovedStorage:
    """One storage moved off the device: the storage itself (now 0 bytes) and its bytes on the host."""

    storage: torch.UntypedStorage
    host: torch.Tensor
    nbytes: int
    kind: OffloadStateTypeEnum


@attrs.define
class OffloadedStates:
    """What one partitioner has offloaded (:func:`held`)."""

    moved: list[MovedStorage] = attrs.Factory(list)
    kinds: set[OffloadStateTypeEnum] = attrs.Factory(set)

    def nbytes(self, kind: OffloadStateTypeEnum | None = None) -> int:
        """Bytes held on the host for ``kind`` (all kinds when None)."""
        return sum(m.nbytes for m in self.moved if kind is None or m.kind == kind)


# -- which tensors hold each kind of state --------------------------------------------------------

def _flatten(value: Any) -> Iterator[torch.Tensor]:
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _flatten(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _flatten(item)


def _spare(pool: Any) -> list[torch.Tensor]:
    return list(getattr(pool, "_free", []) or [])


def state_tensors(part: "ZeroPartitioner", kind: OffloadStateTypeEnum) -> Iterator[torch.Tensor]:
    """The tensors holding ``kind`` in this partitioner and its model (views included; storages
    are deduplicated by the caller). The stages' attribute names are listed here, in one place."""
    params = list(part.module.parameters())
    if kind is OffloadStateTypeEnum.optim_states:
        yield from _flatten(list(part.optimizer.state.values()))
    elif kind is OffloadStateTypeEnum.hp_params:
        yield from _flatten(getattr(part, "master", []))
    elif kind is OffloadStateTypeEnum.lp_params:
        yield from (p.data for p in params)
        yield from _flatten(getattr(part, "param_bufs", []))
        for unit in getattr(part, "sharded", []):  # stage 3: this rank's shards
            yield unit.shard
        yield from _spare(getattr(part, "_spares", None))
    elif kind is OffloadStateTypeEnum.lp_grads:
        yield from (p.grad for p in params if p.grad is not None)
        yield from (g["params"][i].grad for g in part.optimizer.param_groups for i in range(len(g["params"]))
                    if g["params"][i].grad is not None)
        for name in ("grad_bufs", "grad_shards", "staged_grads"):
            yield from _flatten(getattr(part, name, []))
    elif kind is OffloadStateTypeEnum.contiguous_grad_buffer:
        buckets = getattr(part, "buckets", None)  # stages 2-3: zkit.zero.scratch_buckets
        yield from _flatten([s for s in (buckets.segments if buckets is not None else []) if s is not None])
        yield from _flatten(getattr(part, "_scratch", {}))
        yield from _spare(getattr(part, "_grad_spares", None))


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage as a flat uint8 tensor (a view: writes go to the storage)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


# -- the calls -------------------------------------------------------------------------------------

def _kinds(include: Iterable[Any] | None) -> list[OffloadStateTypeEnum]:
    if include is None:
        return list(OffloadStateTypeEnum)
    if isinstance(include, (str, OffloadStateTypeEnum)):
        include = [include]
    kinds = []
    for item in include:
        try:
            kinds.append(OffloadStateTypeEnum(item))
        except ValueError:
            valid = ", ".join(k.value for k in OffloadStateTypeEnum)
            raise ValueError(f"offload_states(include=...): {item!r} is not a state type; valid: {valid}") from None
    return kinds


def _device_name(device: Any) -> str:
    value = device.value if isinstance(device, enum.Enum) else device
    if str(value) not in {d.value for d in OffloadDeviceEnum}:
        raise ValueError(f"offload_states(device=...): {device!r} is not one of none, cpu, nvme")
    return str(value)


def _offload_section(part: "ZeroPartitioner", key: str) -> str:
    section = zero_config(part.ctx.config)
    value = getattr(section, key, None)
    device = getattr(value, "device", None) if value is not None else None
    if device is None and isinstance(value, dict):
        device = value.get("device")
    return str(device or "none").lower()


def _refine(part: "ZeroPartitioner", kinds: list[OffloadStateTypeEnum]) -> list[OffloadStateTypeEnum]:
    """DeepSpeed's rule: with the optimizer offloaded, its master and state are on the host
    already (and at stage 3 the gradients too); those are not moved."""
    if _offload_section(part, "offload_optimizer") == "none":
        return kinds
    skip = {OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states}
    if part.stage == 3:
        skip.add(OffloadStateTypeEnum.lp_grads)
    return [k for k in kinds if k not in skip]


def _accelerator() -> Any:
    return torch.cuda if torch.cuda.is_available() else None


def held(part: "ZeroPartitioner") -> OffloadedStates:
    """What ``part`` has offloaded now (kept on the partitioner, made on first use)."""
    return part.__dict__.setdefault("_offloaded_states", OffloadedStates())


def offloaded_kinds(part: "ZeroPartitioner") -> list[str]:
    """The kinds of state ``part`` holds off the device now (empty: none)."""
    state = part.__dict__.get("_offloaded_states")
    return sorted(k.value for k in state.kinds) if state is not None and state.moved else []


def offload_states(part: "ZeroPartitioner", include: Iterable[Any] | None = None, device: Any = OffloadDeviceEnum.cpu,
                   pin_memory: bool = True, non_blocking: bool = False) -> None:
    """Move the states of the kinds in ``include`` (all when None) to ``device`` (only ``cpu``;
    ``none`` does nothing, with a warning, as in DeepSpeed; ``nvme`` is refused). ``pin_memory``
    pins the host copies where an accelerator can use pinned memory. Kinds already offloaded are
    left as they are."""
    where = _device_name(device)
    kinds = _kinds(include)
    if _offload_section(part, "offload_param") != "none":
        raise ValueError("offload_states() cannot move states of an engine whose parameters are offloaded "
                         "(zero_optimization.offload_param): they already live off the device")
    if where == OffloadDeviceEnum.none.value:
        log.warning("offload_states(device='none'): no device given, nothing is offloaded")
        return
    if where == OffloadDeviceEnum.nvme.value:
        raise ValueError("offload_states(device='nvme') is not supported: states are offloaded to cpu memory only")
    # overlap_param_gather: the step's all-gathers may still be writing into the parameters'
    # buffers, which must not be emptied under them
    part.wait_for_parameters()
    state = held(part)
    done = {m.storage._cdata for m in state.moved}
    pin = pin_memory and _accelerator() is not None
    for kind in _refine(part, kinds):
        if kind in state.kinds:
            continue
        for tensor in state_tensors(part, kind):
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in done or storage.nbytes() == 0 or storage.device != part.ctx.device or not storage.resizable():
                continue
            nbytes = storage.nbytes()
            host = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)
            host.copy_(_bytes_of(storage), non_blocking=non_blocking)
            storage.resize_(0)  # the device memory goes back; every view keeps this storage object
            state.moved.append(MovedStorage(storage, host, nbytes, kind))
            done.add(key)
        state.kinds.add(kind)
    accelerator = _accelerator()
    if accelerator is not None:
        if not non_blocking:
            accelerator.synchronize()
        gc.collect()
        accelerator.empty_cache()


def reload_states(part: "ZeroPartitioner", non_blocking: bool = False) -> None:
    """Bring back everything :func:`offload_states` moved, into the same storages."""
    state = held(part)
    for moved in state.moved:
        moved.storage.resize_(moved.nbytes)
        _bytes_of(moved.storage).copy_(moved.host, non_blocking=non_blocking)
    accelerator = _accelerator()
    if accelerator is not None and state.moved:
        accelerator.synchronize()  # the host copies are released below
    state.moved.clear()
    state.kinds.clear()
