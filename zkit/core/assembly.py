"""The assembly: where one training job's communicators, allocator and stores come from.

An :class:`Assembly` is built from a plugin manager, a loaded config and a stack (the records they
resolve to). Everything that talks between ranks or holds model states gets its parts here rather
than constructing a class of its own choosing, so a communicator a third party registers and the
stack (or a plugin's ``zkit_configure``) chooses is the one every process group uses::

    engine.assembly.communicator(group)      # one communicator per torch process group, cached
    engine.assembly.allocator                # the allocator record's, built once
    engine.assembly.param_shard_store(dtype)  # the allocator's stage-3 shard store, or None

The engine builds one (``engine.assembly``); plugins reach it through the engine their hooks are
given. Code that runs before an engine exists (``zkit.zero.Init``, a pipeline module's grid) builds
one from the same config with :meth:`Assembly.build`, or holds a communicator that its plugin points
at the engine's assembly once there is one (the built-in
``zkit.torch_distributed.deferred_communicator.DeferredCommunicator``, bound in ``zkit_engine_setup``).
"""
from __future__ import annotations

from typing import Any

import torch

from zkit.core import distributed
from zkit.core.communicator import Communicator
from zkit.core.config import ZkitConfig, load_config
from zkit.core.plugin_manager import ZkitPluginManager, get_plugin_manager
from zkit.core.records import CommunicatorRecord, Record
from zkit.core.stack import Stack, config_choice, configure

#: the config an assembly is built from when none is given (a batch size is all a config needs)
DEFAULT_CONFIG: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}


class Assembly:
    """The parts the records of ``(pm, config, stack)`` make, handed out on request.

    ``records`` are the resolved records of every family (:func:`zkit.core.stack.configure`); ``device``
    the training device the allocator places buffers on."""

    def __init__(
        self,
        pm: ZkitPluginManager,
        config: ZkitConfig,
        stack: Stack,
        records: dict[str, Record | None],
        device: torch.device,
    ) -> None:
        self.pm, self.config, self.stack, self.records, self.device = pm, config, stack, records, device
        self._communicators: dict[tuple[str, Any], Communicator] = {}
        self._allocator: Any = None
        #: the communicator every process group gets: the stack's (or a plugin's) choice, else the
        #: default. A communicator that wraps another (1-bit compression over torch's) and one an
        #: optimizer chooses for itself are for the data-parallel gradient exchange only
        #: (:meth:`gradient_communicator`): other groups get what it wraps, so activations, tied
        #: weights, losses and norms stay exact.
        self.communicator_record: CommunicatorRecord = self._unwrapped_choice()

    @classmethod
    def build(
        cls,
        config: Any = None,
        stack: Stack | None = None,
        *,
        pm: ZkitPluginManager | None = None,
        world_size: int | None = None,
    ) -> "Assembly":
        """An assembly for code that runs without an engine: ``config`` (a dict, a JSON path or a
        :class:`ZkitConfig`; default :data:`DEFAULT_CONFIG`) validated for ``world_size`` ranks
        (default: the torch.distributed world), the installed plugins plus ``stack.plugins``."""
        stack = stack or Stack()
        distributed.ensure_initialized()
        pm = pm or get_plugin_manager(extra_plugins=stack.plugins)
        world = world_size or torch.distributed.get_world_size()
        config = load_config(DEFAULT_CONFIG if config is None else config, world_size=world,
                             sections=pm.config_sections())
        merged, records = configure(pm, stack, config)  # no engine device: plugins choose for none
        return cls(pm, config, merged, records, distributed.default_device())

    # -- communicators ------------------------------------------------------------------------------
    def _unwrapped_choice(self) -> CommunicatorRecord:
        chosen = self.stack.communicator
        record = chosen if isinstance(chosen, CommunicatorRecord) else self.pm.lookup(
            "communicator", chosen or config_choice("communicator", self.config))
        assert isinstance(record, CommunicatorRecord)
        while record.wraps:
            record = self.pm.lookup("communicator", record.wraps)
        return record

    def communicator(self, group: Any = None) -> Communicator:
        """The communicator over torch process ``group`` (``None``: the default group), built on
        first request and the same object afterwards."""
        return self._communicator(self.communicator_record, group)

    def gradient_communicator(self, group: Any = None) -> Communicator:
        """The communicator the partitioner reduces gradients through: the resolved communicator
        record, which an optimizer record may choose (``OptimizerRecord.communicator``). The same
        object as :meth:`communicator` when both records agree."""
        record = self.records["communicator"]
        assert isinstance(record, CommunicatorRecord)
        return self._communicator(record, group)

    def _communicator(self, record: CommunicatorRecord, group: Any) -> Communicator:
        key = (record.name, group)  # holding the group keeps its identity from being reused
        comm = self._communicators.get(key)
        if comm is None:
            if record.wraps:
                # a communicator over another one (1-bit compression over torch's transport)
                transport = self._communicator(self.pm.lookup("communicator", record.wraps), group)
                comm = record.factory(group, self.config, transport=transport)
            else:
                comm = record.factory(group, self.config)
            self._communicators[key] = comm
        return comm

    # -- allocator and stores -----------------------------------------------------------------------
    @property
    def allocator(self) -> Any:
        """The allocator record's allocator on :attr:`device`, built on first use."""
        if self._allocator is None:
            self._allocator = self.records["allocator"].factory(self.device, self.config)
        return self._allocator

    def param_shard_store(self, dtype: torch.dtype) -> Any:
        """Where the allocator keeps stage-3 parameter shards (``None``: in its buffers)."""
        return self.allocator.param_shard_store(dtype)

    def close(self) -> None:
        """Free what the parts created (the allocator's files, communicators' own groups)."""
        if self._allocator is not None:
            self._allocator.close()
        for comm in self._communicators.values():  # one object per key: each is closed once
            comm.close()
