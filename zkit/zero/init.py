"""Building and touching stage-3 partitioned models from user code.

``with zkit.zero.Init():`` partitions each module's parameters as soon as the module is built, so a
model larger than one rank's memory can be constructed (each rank only ever holds one module's full
parameters at a time). A parent that re-initialises its children's parameters in its own
``__init__`` (``nn.init.normal_(self.head.weight)``, GPT-style ``reset_parameters``) works: inside
the context an in-place function on a partitioned parameter gathers it, runs on rank 0's values
(broadcast, so every world size builds the same model), keeps the result in the shards and
releases it again. With a ``config`` whose allocator keeps stage-3 shards in a store
(zkit-offload's ``offload_param.device: nvme``), each module's shard goes there as soon as the
module is built: host memory never holds the model.

``with zkit.zero.GatheredParameters(params, modifier_rank=0):`` gathers partitioned parameters for
reading or editing; edits made on ``modifier_rank`` are broadcast and written back into every
rank's shard (and the engine's fp32 master) on exit. Every rank must enter both contexts together,
like any collective.
"""
from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from zkit.core import distributed
from zkit.core.assembly import Assembly
from zkit.core.config import ZkitConfig
from zkit.core.config import read_config_file
from zkit.zero.config import zero_config
from zkit.zero.flat import plan_units
from zkit.zero.memory_param_store import IN_MEMORY
from zkit.zero.param_refresh import wait_for_parameter_refresh
from zkit.zero.sharded_params import ACTIVE, ShardedUnit, ZeroParameter


def _subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


class Init:
    """Partition parameters at module construction (see the module docstring).

    ``dtype`` (or a config with fp16/bf16 enabled) stores the shards in that dtype right away.
    The communicator is the one the registry gives for this config and ``stack`` (the stack you
    will pass to ``zkit.initialize``): a communicator that stack or an installed plugin chooses
    carries Init's broadcasts too.
    """

    def __init__(
        self,
        config: Any = None,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        *,
        config_dict_or_path: Any = None,
        stack: Any = None,
    ) -> None:
        # DeepSpeed's keyword is config_dict_or_path (``config`` its older name): one or the other
        if config is not None and config_dict_or_path is not None:
            raise ValueError("zero.Init: give the config as config= or config_dict_or_path=, not both")
        self.enabled = enabled
        self.dtype = dtype
        self.config = config if config is not None else config_dict_or_path
        self.stack = stack
        self._patched: list[tuple[type, Any]] = []

    #: enabled Init contexts in force (see :func:`building_under_init`)
    entered = 0

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        distributed.ensure_initialized()
        # the host-memory plugin's zkit_configure sets glibc's policy before any module is built
        config = _as_init_reads(self.config)
        self.assembly = Assembly.build(config, self.stack)
        self.comm = self.assembly.communicator(None)
        self.device = self.assembly.device
        self._use_config_allocator(config is not None)
        for cls in [torch.nn.Module, *_subclasses(torch.nn.Module)]:
            self._wrap(cls)
        original_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")
        init = self

        def init_subclass(cls, **kwargs):
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            init._wrap(cls)  # classes defined inside the context are partitioned too

        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)
        self._patched.append((torch.nn.Module, ("__init_subclass__", original_init_subclass)))
        self._active = (ACTIVE.fetch, ACTIVE.after_use)
        ACTIVE.fetch, ACTIVE.after_use = self._gather, self._after_use
        Init.entered += 1
        return self

    def _use_config_allocator(self, given: bool) -> None:
        """The dtype and the allocator a given config chooses (an offload plugin's shard store);
        without one, or below stage 3, shards stay on the training device."""
        config = self.assembly.config
        if given and self.dtype is None:
            self.dtype = config.dtype
        self.store = IN_MEMORY
        if not given or zero_config(config).stage != 3:
            self.allocator = self.assembly.pm.lookup("allocator", "flat").factory(self.device, config)
            return
        # The config's allocator places the shards from the start: with ``offload_param`` on the
        # host, a model larger than the device is built without ever being on it whole.
        self.allocator = self.assembly.allocator
        self.store = self.assembly.param_shard_store(self.dtype or torch.float32) or IN_MEMORY

    def _gather(self, su: ShardedUnit) -> None:
        su.wait()

    def _after_use(self, su: ShardedUnit, func: Any) -> None:
        """A torch function ran on a gathered parameter inside the context: keep an in-place
        change (rank 0's, on every rank) and release the unit again."""
        if getattr(func, "__name__", "").endswith("_"):
            self.comm.broadcast(su.full, src=0)
            su.write_back(self.comm.rank)
        su.release()

    def _wrap(self, cls: type) -> None:
        original = cls.__dict__.get("__init__")
        if original is None or getattr(original, "_zkit_wrapped", False):
            return
        init = self

        def __init__(module, *args, **kwargs):
            depth = module.__dict__.get("_zkit_init_depth", 0)
            object.__setattr__(module, "_zkit_init_depth", depth + 1)
            try:
                original(module, *args, **kwargs)
            finally:
                object.__setattr__(module, "_zkit_init_depth", depth)
            if depth == 0:
                init._partition(module)

        __init__._zkit_wrapped = True
        cls.__init__ = __init__
        self._patched.append((cls, ("__init__", original)))

    def _partition(self, module: torch.nn.Module) -> None:
        # A tensor-parallel slice (``tensor_parallel = True``, set by zkit-pipeline's layers as they
        # are built) differs on every tensor rank: broadcasting rank 0's would overwrite it, and a
        # unit over the world would mix the slices. It stays whole on its rank, as without Init.
        own = [(n, p) for n, p in module.named_parameters(recurse=False)
               if not isinstance(p, ZeroParameter) and not getattr(p, "tensor_parallel", False)]
        if not own:
            return
        with torch.no_grad():
            for _, p in own:
                p.data = p.data.to(self.device)
                if self.dtype is not None and p.is_floating_point():
                    p.data = p.data.to(self.dtype)
                # identical start on every rank whatever the per-rank RNG state
                self.comm.broadcast(p.data, src=0)
            (unit,) = plan_units([(n, p.shape) for n, p in own], 1 << 62, self.comm.world_size)
            su = ShardedUnit.from_params(unit, [p for _, p in own], self.comm, self.allocator, self.comm.rank, type(module).__name__)
            su.release()
            self.store.adopt([su])

    def __exit__(self, *exc: Any) -> None:
        if hasattr(self, "_active"):
            ACTIVE.fetch, ACTIVE.after_use = self._active
            del self._active
        for cls, (name, original) in reversed(self._patched):
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        self._patched = []
        if self.enabled:
            Init.entered -= 1
            self.assembly.pm.hook.zkit_model_built_partitioned(assembly=self.assembly)


def building_under_init() -> bool:
    """Whether a module built now is partitioned as it is built (an enabled :class:`Init` is in force)."""
    return Init.entered > 0


def _as_init_reads(config: Any) -> Any:
    """The config less what the Init does not read and must not judge:

    * Hugging Face's ``"auto"`` placeholders. transformers builds a model inside
      ``zero.Init(config_dict_or_path=...)`` before it fills them in (scheduler steps, bucket sizes
      from the hidden size);
    * the ``optimizer`` section. Which optimizer trains is decided at ``initialize``, where a
      client's ``optimizer=`` replaces the section (as in DeepSpeed): the plugins' checks of the
      section here would refuse, or name, an optimizer that never runs.

    The engine later gets the whole config and validates it."""
    if config is None:
        return None
    if isinstance(config, ZkitConfig):
        if config.optimizer is None:
            return config
        data = copy.deepcopy(config.raw) if config.raw else config.to_dict()
    else:
        data = read_config_file(Path(config)) if isinstance(config, (str, os.PathLike)) else config

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if not (isinstance(v, str) and v == "auto")}
        return value

    data = strip(data)
    if isinstance(data, dict):
        data.pop("optimizer", None)
    return data


@contextlib.contextmanager
def GatheredParameters(
    params: torch.Tensor | Iterable[torch.Tensor], modifier_rank: int | None = None, enabled: bool = True
) -> Iterator[None]:
    """Gather stage-3 parameters for the block; with ``modifier_rank``, that rank's edits are
    broadcast and kept. Parameters that are not partitioned pass through untouched."""
    if not enabled:
        yield
        return
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    wait_for_parameter_refresh()  # stages 1-2 with overlap_param_gather: values still arriving
    units: list[ShardedUnit] = []
    for p in params:
        su = getattr(p, "_zkit_unit", None)
        if su is not None and all(su is not u for u in units):
            units.append(su)
    was_gathered = [su.full is not None and su.handle is None for su in units]
    for su in units:
        su.wait()
    try:
        yield
    finally:
        if modifier_rank is not None:
            for su in units:
                su.comm.broadcast(su.full, src=modifier_rank)
                su.write_back(su.comm.rank)
        for su, was in zip(units, was_gathered):
            if not was:
                su.release()
