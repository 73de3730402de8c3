"""Partitioned parameters for ZeRO stage 3.

A stage-3 unit's parameters (a block's, or one module's) form one :class:`ShardedUnit`: a flat
buffer, padded and split in equal shards, of which a rank keeps only its shard. The full buffer exists only while the unit is
*gathered*; released parameters keep their shape (their ``.data`` is a one-element placeholder
expanded to the shape, so ``p.shape`` still answers) and are instances of :class:`ZeroParameter`,
whose ``__torch_function__`` gathers a released parameter on use while a stage-3 engine runs its
forward or backward, and otherwise raises an error that says what to do instead of computing with
garbage (``state_dict()`` of such a model gives meta tensors: keys and shapes, no values).

Every shard is in a *shard store* (``ShardedUnit.store``): by default the in-memory one
(:data:`zkit.zero.memory_param_store.IN_MEMORY`), where the shard is the tensor ``ShardedUnit.shard``
(on the device, or on the host when an allocator places purpose ``"param"`` there); an offload
allocator's store may keep it elsewhere (NVMe files read into a few host buffers,
``store.shards_leave_memory``). This module reaches the shard only through
:meth:`ShardedUnit.local_shard`, :meth:`~ShardedUnit.prefetch_shard`, :meth:`~ShardedUnit.set_shard`
and the store's ``release``. The gathered full buffer always lives on the training device.
"""
from __future__ import annotations

import enum
import itertools
import sys
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F

from zkit.core.copies import DONE, Copy
from zkit.core.profiling import span
from zkit.zero.flat import Unit
from zkit.zero.memory_param_store import IN_MEMORY


class _Active:
    """The gather callbacks of the stage-3 context in force. Process-wide, not per thread:
    autograd runs a CUDA backward on its own device thread, not on the thread that entered
    ``backward_context``, and that thread must still gather what it uses."""

    #: callback(unit) used to gather a released parameter on use; None outside forward/backward.
    fetch: Callable[["ShardedUnit"], None] | None = None
    #: callback(unit, func) after a torch function ran on a parameter ``fetch`` gathered
    #: (``zkit.zero.Init``: keep an in-place initialisation and release again); usually None.
    after_use: Callable[["ShardedUnit", Any], None] | None = None


ACTIVE = _Active()


#: Tensor methods that read no values: allowed on released parameters, no gather.
_METADATA = frozenset(
    {
        "__get__", "__set__", "__hash__", "__repr__", "__format__", "__reduce_ex__", "__deepcopy__",
        "size", "dim", "ndimension", "numel", "nelement", "element_size", "is_floating_point",
        "is_complex", "is_contiguous", "get_device", "data_ptr", "requires_grad_", "retain_grad",
        "register_hook", "register_post_accumulate_grad_hook", "untyped_storage", "_is_view",
        "_has_compatible_shallow_copy_type",  # Module._apply asks it of every parameter it converts
    }
)


def _placeholder(p: torch.Tensor) -> torch.Tensor:
    return torch.empty((), dtype=p.dtype, device=p.device).expand(p.shape)


def _zero_params(args: tuple, kwargs: dict) -> Iterable["ZeroParameter"]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, ZeroParameter):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, ZeroParameter):
                    yield b


def ensure_gathered(p: "ZeroParameter") -> None:
    if not p._zkit_released:
        return
    unit = p._zkit_unit
    if ACTIVE.fetch is None:
        raise RuntimeError(
            f"parameter {unit.name_of(p)!r} (shape {tuple(p.shape)}) is partitioned by ZeRO stage 3 and not "
            f"gathered here; read or change it inside `with zkit.zero.GatheredParameters([param], "
            f"modifier_rank=0):`"
        )
    ACTIVE.fetch(unit)


class ParamStatus(enum.Enum):
    """Where a partitioned parameter's values are (DeepSpeed's ``ZeroParamStatus``)."""

    AVAILABLE = 1  #: gathered: the full values are in ``param.data``
    NOT_AVAILABLE = 2  #: released: only the shards exist
    INFLIGHT = 3  #: a gather is under way


_next_param_id = itertools.count()


class ZeroParameter(torch.nn.Parameter):
    """A parameter whose values live in shards across ranks (see the module docstring).

    DeepSpeed's ZeRO-3 attributes are there for code that reads them: ``ds_id`` (a number unique
    in the process, in partitioning order), ``ds_shape`` and ``ds_numel`` (the full parameter's,
    whatever ``param.data`` holds now), ``ds_status`` (a :class:`ParamStatus`) and ``ds_tensor``
    (the part of this parameter that this rank's shard holds, flat; empty when the rank's shard
    has none of it: zkit shards a module's parameters together; a copy when the shard is in a
    store such as NVMe, so writing to it does not change the shard)."""

    _zkit_unit: "ShardedUnit"
    _zkit_released: bool = False
    _zkit_id: int = -1

    @property
    def ds_id(self) -> int:
        return self._zkit_id

    @property
    def ds_shape(self) -> torch.Size:
        return torch.Size(self._zkit_slot().shape)

    @property
    def ds_numel(self) -> int:
        return self._zkit_slot().numel

    @property
    def ds_status(self) -> ParamStatus:
        unit = self._zkit_unit
        if unit.handle is not None:
            return ParamStatus.INFLIGHT
        return ParamStatus.NOT_AVAILABLE if self._zkit_released or unit.full is None else ParamStatus.AVAILABLE

    @property
    def ds_tensor(self) -> torch.Tensor:
        unit = self._zkit_unit
        slot = self._zkit_slot()
        lo, hi = unit.unit.shard_range(unit.comm.rank)
        start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        with torch._C.DisableTorchFunctionSubclass():
            if not unit.store.shards_leave_memory:
                return unit.shard[start - lo : max(start, end) - lo]
            # A stored shard is read into a buffer the store reuses: a copy, and the buffer back.
            shard = unit.store.get(unit)
            try:
                return shard[start - lo : max(start, end) - lo].clone()
            finally:
                unit.store.release(unit)

    def _zkit_slot(self) -> Any:
        unit = self._zkit_unit
        for slot, q in zip(unit.unit.slots, unit.params):
            if q is self:
                return slot
        raise RuntimeError("a ZeroParameter outside its unit")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.detach and ACTIVE.fetch is None and args[0]._zkit_released:
            # module.state_dict() outside forward (Hugging Face reads a partitioned model's keys
            # and shapes before loading weights): the entry has the parameter's shape and dtype
            # on the meta device, so anything that reads its values fails there, loudly.
            return torch.empty(args[0].shape, dtype=args[0].dtype, device="meta")
        if func in _CONVERSIONS and ACTIVE.fetch is None and isinstance(args[0], ZeroParameter) and args[0]._zkit_released:
            converted = _convert_released(args[0], func, args[1:], kwargs)
            if converted is not None:
                return converted
        if getattr(func, "__name__", "") not in _METADATA:
            params = list(_zero_params(args, kwargs))
            released = [p._zkit_unit for p in params if p._zkit_released]
            for p in params:
                ensure_gathered(p)
            if func is F.linear and ACTIVE.fetch is not None and isinstance(args[1] if len(args) > 1 else kwargs.get("weight"), ZeroParameter):
                return _ZeroLinear.apply(*_linear_args(args, kwargs))
            if ACTIVE.after_use is not None and released:
                with torch._C.DisableTorchFunctionSubclass():
                    out = func(*args, **kwargs)
                for unit in dict.fromkeys(released):
                    ACTIVE.after_use(unit, func)
                return out
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


class ResidentZeroParameter(ZeroParameter):
    """A :class:`ZeroParameter` of a persistent unit while it is gathered (the class its
    parameters take then, :class:`ZeroParameter` again once released). Such a unit is never
    released between uses, so nothing is left to intercept: no gather on use, and no
    ``_ZeroLinear`` (it saves the weight parameter instead of a view so that a released unit's
    buffer can be freed before backward; a persistent unit's buffer stays). Torch's own dispatch
    then, as for an ``nn.Parameter``, not a call into Python per op (the default stage 3 of a small
    model keeps every unit so: ``contrib/bench/bench_host_phases.py``)."""

    __torch_function__ = torch._C._disabled_torch_function_impl


#: the tensor methods ``Module.to`` / ``.float()`` / ``.half()`` / ``.bfloat16()`` / ``.cpu()`` apply to
#: each parameter, with the (device, dtype) each asks for
_CONVERSIONS: dict[Any, Callable[..., tuple[Any, Any]]] = {
    torch.Tensor.to: lambda *a, **kw: torch._C._nn._parse_to(*a, **kw)[:2],
    torch.Tensor.float: lambda *a, **kw: (None, torch.float32),
    torch.Tensor.double: lambda *a, **kw: (None, torch.float64),
    torch.Tensor.half: lambda *a, **kw: (None, torch.float16),
    torch.Tensor.bfloat16: lambda *a, **kw: (None, torch.bfloat16),
    torch.Tensor.cpu: lambda *a, **kw: (torch.device("cpu"), None),
}
_MODULE_APPLY = torch.nn.Module._apply.__code__


def _called_by_module_apply() -> bool:
    """Whether ``Module._apply`` (``module.to(...)`` and the like) is converting the parameter."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        if frame.f_code is _MODULE_APPLY:
            return True
        frame = frame.f_back
    return False


def _convert_released(p: "ZeroParameter", func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A conversion of a released parameter: the parameter itself when nothing changes (as
    ``Tensor.to`` answers, with no gather: DeepSpeed-Chat's LoRA layers move a partitioned weight
    to its own device and dtype); inside ``Module._apply`` a real change converts the unit's
    shard, and the placeholder in the new dtype/device is what the module keeps. ``None``: a
    real change of one tensor, which needs its values (the caller raises that it is not
    gathered)."""
    device, dtype = _CONVERSIONS[func](*args, **kwargs)
    device = torch.device(device) if device is not None else None
    same_device = device is None or (device.type == p.device.type and device.index in (None, p.device.index))
    if (dtype is None or dtype == p.dtype) and same_device:
        return p
    if not _called_by_module_apply():
        return None
    p._zkit_unit.convert(dtype, device)
    with torch._C.DisableTorchFunctionSubclass():
        return torch.empty((), dtype=dtype or p.dtype, device=device or p.device).expand(p.shape)


def _linear_args(args: tuple, kwargs: dict) -> tuple:
    full = list(args) + [kwargs.get(k) for k in ("input", "weight", "bias")[len(args):]]
    return full[0], full[1], full[2] if len(full) > 2 else None


class _ZeroLinear(torch.autograd.Function):
    """``F.linear`` saving the weight *parameter* itself for backward (torch's own linear saves a
    transposed view, which would keep the gathered buffer alive until backward)."""

    @staticmethod
    def forward(ctx, input, weight, bias):
        ctx.save_for_backward(input)
        ctx.weight = weight  # the parameter object itself: its data is swapped on release/gather
        ctx.has_bias = bias is not None
        with torch._C.DisableTorchFunctionSubclass():
            return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        (input,) = ctx.saved_tensors
        weight = ctx.weight
        ensure_gathered(weight)
        with torch._C.DisableTorchFunctionSubclass():
            grad_input = grad_out @ weight if ctx.needs_input_grad[0] else None
            flat_out = grad_out.reshape(-1, grad_out.shape[-1])
            flat_in = input.reshape(-1, input.shape[-1])
            grad_weight = None
            if ctx.needs_input_grad[1]:
                spares = weight._zkit_unit.grad_spares
                # not in a compiled backward: Dynamo traces the buffer the pool held at trace time
                # into the graph and guards on the pool's free list (wrong gradients under recompute)
                if (spares is not None and flat_out.dtype == flat_in.dtype == weight.dtype
                        and not torch.compiler.is_compiling()):
                    # into the host buffer of an earlier gradient (stage 3 gives it back once reduced)
                    out = spares.take(weight.numel(), weight.dtype, weight.device).view(weight.shape)
                    grad_weight = torch.mm(flat_out.t(), flat_in, out=out)
                else:
                    grad_weight = flat_out.t() @ flat_in
            grad_bias = flat_out.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias


def _param_class(persistent: bool, released: bool) -> type[ZeroParameter]:
    return ResidentZeroParameter if persistent and not released else ZeroParameter


def unpack_saved(t: Any) -> Any:
    """saved-tensor hook: a parameter saved for backward is gathered again when backward needs it."""
    if isinstance(t, ZeroParameter):
        ensure_gathered(t)
    return t


class GatheredElements:
    """The elements of the released (non-persistent) units gathered now, counted by the units as
    they gather and release: the partitioner's limit checks read it at every gather and keep
    decision, which must not walk every unit of a model of thousands of modules."""

    __slots__ = ("numel",)

    def __init__(self) -> None:
        self.numel = 0


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


class SpareBuffers:
    """Freed host buffers kept for the next request of the same size and dtype: stage 3's
    gathered units, and (in a pool of their own) the weight gradients its linear computes.

    Where glibc's mmap threshold is fixed (:mod:`zkit.host_memory`: memory is tight, or an NVMe
    offload runs), every freed large buffer is unmapped, and the next one of that size is mapped
    afresh and takes a page fault per 4 KiB page as it is written. A stage-3 step uses the same
    few sizes over and over, so keeping a few freed buffers saves those faults
    (``contrib/bench/bench_host_malloc.py``: the fixed threshold cost a 2-rank stage-3 step
    1.21-1.24x the time of glibc's default before, 1.11-1.17x with them).

    At most ``limit_bytes`` are kept: a buffer given when the pool is full pushes out the ones
    given longest ago. A pool that refused the newest instead would fill with sizes asked for
    earlier and then miss every request of the sizes in use now (a GPT's units come in four
    sizes, cycled through in each layer). :meth:`clear` hands them back (stage 3 calls it when
    backward ends, before the optimizer step wants the memory). Device buffers are never kept:
    torch's caching allocator already reuses them. Nor is a buffer whose storage another tensor
    still uses (a view that autograd saved): the next user would overwrite it."""

    __slots__ = ("limit", "kept", "_free")

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.kept = 0
        self._free: list[torch.Tensor] = []  # in the order given, oldest first (a few buffers)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            for i in range(len(self._free) - 1, -1, -1):  # the latest of that size and dtype
                t = self._free[i]
                if t.numel() == numel and t.dtype == dtype:
                    return self._drop(i)
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or _storage_use_count is None or nbytes > self.limit:
            return
        # 2: the tensor's own reference and the storage object asked for here; more is a view
        if _storage_use_count(t.untyped_storage()._cdata) > 2:
            return
        while self.kept + nbytes > self.limit:
            self._drop(0)
        self._free.append(t)
        self.kept += nbytes

    def _drop(self, i: int) -> torch.Tensor:
        t = self._free.pop(i)
        self.kept -= t.numel() * t.element_size()
        return t

    def clear(self) -> None:
        self._free.clear()
        self.kept = 0


class ShardedUnit:
    """One module's parameters as a flat buffer of which this rank keeps shard ``rank``."""

    def __init__(self, unit: Unit, params: list[torch.nn.Parameter], shard: torch.Tensor, comm: Any, allocator: Any, module_name: str) -> None:
        self.unit = unit
        self.params = params
        self.shard = shard
        self.comm = comm
        self.allocator = allocator
        self.module_name = module_name
        self._full: torch.Tensor | None = None
        self.handle: Any = None
        self._persistent = False
        #: the partitioner's count of gathered elements, kept by this unit when it is released
        #: between uses (not persistent); None: not counted
        self.gathered_count: GatheredElements | None = None
        #: where this unit's gathered buffer comes from and goes back to (set by the stage-3
        #: partitioner for released units); None: a new buffer each gather
        self.spares: SpareBuffers | None = None
        #: where the gradients of this unit's weights computed by stage 3's linear come from
        #: (their own budget: they must not crowd out the gathered buffers); None: new ones
        self.grad_spares: SpareBuffers | None = None
        #: the fp32 master of this shard when it is a separate copy (set by the stage-3 partitioner).
        self.master: torch.Tensor | None = None
        #: the store of the shard: in memory (``shard``), or an offload allocator's (``shard`` None)
        self.store: Any = IN_MEMORY
        self._gather_src: torch.Tensor | None = None
        #: the gather in flight holds a buffer of a store whose shards leave memory (given back by
        #: ``_done_with_store``)
        self._holds_store = False
        #: the last copy into the shard or out of it for a gather (``allocator.copies``)
        self.copy: Copy = DONE
        #: the gathered buffer is the shard itself (one rank, the shard in memory on the device)
        self.full_is_shard = False
        #: the parameters' views of the shard while ``full_is_shard`` (the shard, the views), and
        #: their placeholders while released ((dtype, device), the placeholders): made once, not
        #: per gather and release
        self._shard_views: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self._placeholders: tuple[tuple[torch.dtype, torch.device], list[torch.Tensor]] | None = None
        for p in params:
            p.__class__ = ZeroParameter
            p._zkit_unit = self
            p._zkit_released = False
            p._zkit_id = next(_next_param_id)

    @property
    def persistent(self) -> bool:
        """Kept gathered between uses (``stage3_param_persistence_threshold``); while it is
        gathered, its parameters are :class:`ResidentZeroParameter`."""
        return self._persistent

    @persistent.setter
    def persistent(self, value: bool) -> None:
        self._persistent = value
        for p in self.params:
            p.__class__ = _param_class(value, p._zkit_released)

    @property
    def full(self) -> torch.Tensor | None:
        """The gathered parameters (the whole padded unit), or None while released."""
        return self._full

    @full.setter
    def full(self, value: torch.Tensor | None) -> None:
        if self.gathered_count is not None and not self.persistent and (value is None) != (self._full is None):
            self.gathered_count.numel += self.unit.padded if value is not None else -self.unit.padded
        self._full = value

    @classmethod
    def from_params(cls, unit: Unit, params: list[torch.nn.Parameter], comm: Any, allocator: Any, rank: int, module_name: str,
                    dtype: torch.dtype | None = None) -> "ShardedUnit":
        """Keep this rank's shard of the parameters' current (full) values (cast to ``dtype``, by
        default theirs), then release them."""
        dtype, device = dtype or params[0].dtype, params[0].device
        flat = torch.zeros(unit.padded, dtype=dtype, device=device)
        for slot, p in zip(unit.slots, params):
            flat[slot.offset : slot.offset + slot.numel].copy_(p.data.reshape(-1))
        lo, hi = unit.shard_range(rank)
        shard = allocator.empty(unit.shard, dtype, "param")
        shard.copy_(flat[lo:hi])
        self = cls(unit, params, shard, comm, allocator, module_name)
        self.full = flat
        allocator.track("param", flat.numel() * flat.element_size())
        self._attach()
        return self

    def name_of(self, p: torch.Tensor) -> str:
        for slot, q in zip(self.unit.slots, self.params):
            if q is p:
                return slot.name
        return "?"

    @property
    def gathered(self) -> bool:
        return self.full is not None and self.handle is None

    def stored_in(self, store: Any) -> None:
        """The shard now lives in ``store`` (a :class:`~zkit.core.stores.ParamShardStore` that adopted
        it): the unit keeps none in memory and reads it through the store."""
        self.shard, self.store = None, store

    def shard_to_memory(self, allocator: Any = None) -> None:
        """Take the shard out of its store into a buffer of ``allocator`` (the unit's own by
        default), the store forgetting it."""
        self.shard, self.store = self.store.take(self, allocator or self.allocator), IN_MEMORY

    def local_shard(self) -> torch.Tensor:
        """This rank's shard in memory: ``shard`` itself, or the store's resident copy (waits for
        its read; the store keeps it until the gather that uses it is done)."""
        return self.store.get(self)

    def shard_ready(self) -> bool:
        """Whether this rank's shard is in memory now (a stored shard's read has finished)."""
        return self.store.ready(self)

    def prefetch_shard(self) -> None:
        """Start reading a stored shard ahead of its gather (nothing to do for one in memory)."""
        if self.full is None:
            self.store.prefetch(self)

    def set_shard(self, values: torch.Tensor) -> None:
        """New values of this rank's shard (after an optimizer step or an edit)."""
        self.store.put(self, values)

    def fetch(self) -> None:
        """Start gathering (asynchronously) unless gathered or on its way."""
        if self.full is not None:
            return
        # The gathered parameters are computed with: on the training device, wherever shards live.
        device = self.allocator.device
        if self.comm.world_size == 1 and self._shard_serves_as_full(device):
            # One rank, the shard in memory where it is computed with: the shard is the gathered
            # buffer, no copy (used once a write into it still in flight is done).
            self.full_is_shard = True
            self.full = self.shard
            self.handle = self.copy
            return
        if self.spares is not None:
            self.full = self.spares.take(self.unit.padded, self.shard_dtype, device)
        else:
            self.full = torch.empty(self.unit.padded, dtype=self.shard_dtype, device=device)
        self.allocator.track("param", self.full.numel() * self.full.element_size())
        if self.comm.world_size == 1:
            # One rank: the gathered buffer is the shard. A host shard is copied straight in on the
            # side stream and compute waits for it only at use (``wait``), so the copies prefetched
            # ahead overlap the compute before them instead of holding it up as they are issued.
            self.copy.wait()
            self.copy = self.handle = self.allocator.copies.copy(self.full, self.local_shard())
            self._holds_store = self.store.shards_leave_memory
            if self.copy is DONE:
                # Copied on this thread (host and device are one memory): the store's buffer is
                # free for the next read-ahead now, not only once the unit is used.
                self._done_with_store()
            return
        self._gather_src = self.device_shard(device)
        self._holds_store = self.store.shards_leave_memory
        self.handle = self.comm.all_gather(self.full, self._gather_src, async_op=True)

    def _shard_serves_as_full(self, device: torch.device) -> bool:
        shard = self.shard
        return (shard is not None and not self.store.shards_leave_memory and shard.device == device
                and shard.numel() == self.unit.padded)

    def device_shard(self, device: torch.device) -> torch.Tensor:
        """This rank's shard on ``device``, ready for a collective there: a host shard is copied on
        the side stream (pinned: asynchronously), after any write to it still in flight."""
        self.copy.wait()
        src, self.copy = self.allocator.copies.to(self.local_shard(), device)
        self.copy.wait()
        return src

    @property
    def shard_dtype(self) -> torch.dtype:
        return self.shard.dtype if self.shard is not None else self.store.dtype

    def wait(self) -> None:
        """Gather (if needed) and point every parameter at the full buffer."""
        self.fetch()
        if self.handle is not None:
            self._finish_gather()
            self._attach()

    def _finish_gather(self) -> None:
        self.handle.wait()
        self.handle = None
        self._gather_src = None
        self._done_with_store()

    def _done_with_store(self) -> None:
        """Hand the store's host buffer back once the gather's copy out of it is done."""
        if self._holds_store:
            self._holds_store = False
            self.copy.synchronize()  # the store reuses the host buffer the copy read
            self.store.release(self)

    def _attach(self) -> None:
        if self.full_is_shard:
            if self._shard_views is None or self._shard_views[0] is not self.full:
                self._shard_views = (self.full, self._views(self.full))
            views = self._shard_views[1]
        else:
            views = self._views(self.full)
        cls = _param_class(self._persistent, released=False)
        for view, p in zip(views, self.params):
            p.data = view
            p._zkit_released = False
            p.__class__ = cls

    def _views(self, full: torch.Tensor) -> list[torch.Tensor]:
        return [full[slot.offset : slot.offset + slot.numel].view(slot.shape) for slot in self.unit.slots]

    def release(self, force: bool = False) -> None:
        """Drop the full buffer (unless persistent); parameters become placeholders."""
        if self.full is None or (self.persistent and not force):
            return
        with span("release %r", self.module_name or "root"):  # host time per release in profiler traces
            if self.handle is not None:
                self._finish_gather()
            where = (self.full.dtype, self.full.device)
            if self._placeholders is None or self._placeholders[0] != where:
                self._placeholders = (where, [_placeholder(p) for p in self.params])
            for placeholder, p in zip(self._placeholders[1], self.params):
                p.data = placeholder
                p._zkit_released = True
                p.__class__ = ZeroParameter
            full, self.full = self.full, None
            if self.full_is_shard:
                self.full_is_shard = False
                return
            self.allocator.release(full, "param")
            if self.spares is not None:
                self.spares.give(full)

    def convert(self, dtype: torch.dtype | None, device: torch.device | None) -> None:
        """``module.to(dtype/device)`` on a released unit built by ``zkit.zero.Init``: its shard
        takes the new dtype and device (once for the unit; a module's parameters share it). An
        engine's units keep the dtype and placement its config chose: refused there."""
        dtype = dtype or self.shard_dtype
        if self.gathered_count is not None or self.master is not None:
            raise RuntimeError(
                f"module {self.module_name!r}: its parameters are partitioned by a ZeRO stage 3 engine, which keeps "
                f"them in {self.shard_dtype} where its config puts them; converting them to {dtype} after initialize "
                "is not supported. Convert the model before initialize, or change the config's bf16/fp16 sections"
            )
        if self.shard is None:
            raise RuntimeError(
                f"module {self.module_name!r}: its shards are in a shard store ({type(self.store).__name__}, "
                "offload_param), which keeps them in the dtype it was built with; converting them is not supported"
            )
        device = device or self.shard.device
        if self.shard.dtype == dtype and self.shard.device == device:
            return  # converted with an earlier parameter of this unit
        old = self.shard
        self.shard = old.to(device=device, dtype=dtype)
        self.allocator.release(old, "param")
        self.allocator.track("param", self.shard.numel() * self.shard.element_size())

    def drop(self) -> None:
        """Free the buffers of a unit whose parameters other units hold now (regrouped by stage 3)."""
        if self.handle is not None:
            self._finish_gather()
        if self.full is not None and not self.full_is_shard:
            self.allocator.release(self.full, "param")
        self.full, self.full_is_shard = None, False
        if self.shard is not None:
            self.allocator.release(self.shard, "param")
            self.shard = None
        self.params = []

    def write_back(self, rank: int) -> None:
        """Copy this rank's range of the (gathered, possibly edited) full buffer into its shard."""
        lo, hi = self.unit.shard_range(rank)
        self.set_shard(self.full[lo:hi])
        if self.master is not None:
            self.master.copy_(self.full[lo:hi])
