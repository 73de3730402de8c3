"""The allocator family of zkit-offload: ``"host"`` (ZeRO-Offload) and ``"nvme"`` (ZeRO-Infinity).

``host`` puts the buffers the CPU optimizer touches (``"master"``, ``"master_grad"``,
``"optim_state"``) in host memory when ``offload_optimizer.device`` is set, page-locked when CUDA is
present and ``pin_memory`` is set so that device<->host copies are asynchronous; with
``offload_param.device`` set, stage-3 parameter shards (``"param"``) live on the host too (the
gathered full parameters stay on the device). Everything else stays on the device. On a CPU-only
machine the device *is* the host and nothing is copied.

``nvme`` is ``host`` plus NVMe swappers: with ``offload_optimizer.device == "nvme"`` optimizer state
is kept on NVMe between steps and streamed through ``buffer_count`` host buffer sets (the
partitioner splits its flat shard into sub-groups of ``sub_group_size`` elements and steps them with
:meth:`NVMeAllocator.step_optimizer`); with ``offload_param.device == "nvme"`` stage 3 keeps its
parameter shards in a :class:`~zkit_offload.param_store.NVMeParamStore`. See docs/plugins/offload.md.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Container, Mapping, Sequence

import torch

from zkit.core.allocator import Allocator
from zkit.zero import CopyQueue

if TYPE_CHECKING:  # pragma: no cover
    from zkit_offload.cpu_optimizer import FusedCPUOptimizer
from zkit_offload.config import AioConfig, OffloadOptimizerConfig, OffloadParamConfig
from zkit_offload.host_master import HostMasterStore
from zkit.host_memory import return_freed_memory
from zkit_offload.param_store import NVMeParamStore
from zkit_offload.pipeline import SubGroupBuffers, step_in_subgroups, subgroup_key
from zkit_offload.swap import NVMeSwapper, aligned_empty
from zkit_offload.swapped_master import SwappedMasterStore
from zkit_offload.swapped_state import SubGroupPlan, SwappedState

HOST_PURPOSES = ("master", "master_grad", "optim_state")


def _section(config: Any, path: str, cls: type) -> Any:
    """The section ``path`` of a zkit config, an instance of ``cls`` already, or the default."""
    if config is None:
        return cls()
    if isinstance(config, cls):
        return config
    if hasattr(config, "section"):
        found = config.section(path)
        return found if found is not None else cls()
    raise TypeError(f"expected a zkit config or {cls.__name__}, got {type(config).__name__}")


class HostAllocator(Allocator):
    """Master weights, their gradients and optimizer state in (pinned) host memory."""

    def __init__(self, device: torch.device, config: Any = None, *,
                 optimizer: OffloadOptimizerConfig | None = None, param: OffloadParamConfig | None = None) -> None:
        super().__init__(device)
        self.copies = CopyQueue(self.device)  # host<->device copies on a side stream (an accelerator's)
        self.optimizer_config = optimizer or _section(config, OffloadOptimizerConfig.SECTION, OffloadOptimizerConfig)
        self.param_config = param or _section(config, OffloadParamConfig.SECTION, OffloadParamConfig)
        self.host_purposes = ((HOST_PURPOSES if self.optimizer_config.device != "none" else ())
                              + (("param",) if self.param_config.device != "none" else ()))
        self._master_store: SwappedMasterStore | HostMasterStore | None = None

    def master_store(self, shard_sizes: Sequence[int]) -> SwappedMasterStore | HostMasterStore | None:
        """Stages 2-3 with ``offload_optimizer.device == "cpu"`` and ``step_in_backward``: a
        :class:`~zkit_offload.host_master.HostMasterStore`, which steps each unit during the
        batch's last backward; otherwise ``None`` (the partitioner's own in-memory master)."""
        if not (self.optimizer_config.device == "cpu" and self.optimizer_config.step_in_backward):
            return None
        if self._master_store is not None:
            raise ValueError("this allocator already holds the master of one partitioner")
        self._master_store = HostMasterStore(self, shard_sizes)
        return self._master_store

    @property
    def master_store_made(self) -> SwappedMasterStore | HostMasterStore | None:
        """The store :meth:`master_store` handed a partitioner, if any (the plugin's hooks reach it
        here: the kernel's store protocol says nothing of stepping in backward)."""
        return self._master_store

    def place(self, purpose: str) -> torch.device:
        return torch.device("cpu") if purpose in self.host_purposes else self.device

    def pin(self, purpose: str) -> bool:
        if purpose == "param":
            return self.param_config.pin_memory
        return purpose in self.host_purposes and self.optimizer_config.pin_memory

    def close(self) -> None:
        """Stop the host step's thread, if a store made one (host memory needs no freeing)."""
        if isinstance(self._master_store, HostMasterStore):
            self._master_store.close()


class NVMeAllocator(HostAllocator):
    """:class:`HostAllocator` with optimizer state and/or stage-3 parameter shards on NVMe.

    Attributes:
        swapper: the optimizer-state :class:`NVMeSwapper` (files under
            ``offload_optimizer.nvme_path``), or ``None`` when the optimizer is not on NVMe.
        param_swapper: the parameter-shard swapper (``offload_param.nvme_path``), or ``None``.
    """

    def __init__(self, device: torch.device, config: Any = None, *,
                 optimizer: OffloadOptimizerConfig | None = None, param: OffloadParamConfig | None = None,
                 aio: AioConfig | None = None) -> None:
        super().__init__(device, config, optimizer=optimizer, param=param)
        if self.optimizer_config.device != "nvme" and self.param_config.device != "nvme":
            raise ValueError("the 'nvme' allocator needs zero_optimization.offload_optimizer.device or "
                             "zero_optimization.offload_param.device 'nvme' (with an nvme_path)")
        self.aio = aio or _section(config, AioConfig.SECTION, AioConfig)
        return_freed_memory(because="NVMe offload")  # freed shards and buffers go back to the OS at once
        self.swapper: NVMeSwapper | None = None
        self.param_swapper: NVMeSwapper | None = None
        if self.optimizer_config.device == "nvme":
            self.swapper = NVMeSwapper(self.optimizer_config.nvme_path, block_size=self.aio.block_size,
                                       io_threads=self.aio.io_threads)
        if self.param_config.device == "nvme":
            self.param_swapper = NVMeSwapper(self.param_config.nvme_path, block_size=self.aio.block_size,
                                             io_threads=self.aio.io_threads)
        self._param_stores: list[NVMeParamStore] = []
        zero = config.section("zero_optimization") if hasattr(config, "section") else None
        #: elements per sub-group of the optimizer step (``zero_optimization.sub_group_size``)
        self.sub_group_size = max(1, int(getattr(zero, "sub_group_size", 1_000_000_000)))
        self._buffers: SubGroupBuffers | None = None
        self._stepped: set[int] = set()
        self._plan: SubGroupPlan | None = None

    def param_shard_store(self, dtype: torch.dtype) -> NVMeParamStore | None:
        """Where stage 3 keeps its parameter shards: an :class:`NVMeParamStore` with
        ``offload_param.device == "nvme"``, else ``None`` (shards in memory, placed by :meth:`place`)."""
        if self.param_swapper is None:
            return None
        c = self.param_config
        store = NVMeParamStore(self.param_swapper, self, dtype, buffer_count=c.buffer_count,
                               buffer_size=c.buffer_size, max_in_cpu=c.max_in_cpu)
        self._param_stores.append(store)
        return store

    def stats(self) -> dict[str, dict[str, int]]:
        """Host bytes per purpose (:meth:`Allocator.stats`) plus ``"optim_state_nvme"`` and
        ``"param_nvme"``: bytes in swap files, which are not host memory."""
        stats = super().stats()
        on_disk = {"optim_state_nvme": self._optimizer_nvme_bytes(),
                   "param_nvme": sum(s.nvme_bytes for s in self._param_stores)}
        for purpose, nbytes in on_disk.items():
            if nbytes:
                stats[purpose] = {"live": nbytes, "peak": nbytes}
        return stats

    def _optimizer_nvme_bytes(self) -> int:
        if self._master_store is not None:  # master and gradients too, from the start
            return self._master_store.nvme_bytes
        if self._plan is None:
            return 0
        return sum(self._plan.sizes) * len(self._plan.state_names) * 4  # fp32 state tensors

    def empty(self, numel: int, dtype: torch.dtype, purpose: str) -> torch.Tensor:
        # Host buffers aligned for direct I/O: the swapper then reads and writes them in place.
        if self.place(purpose).type == "cpu" and not (self.pin(purpose) and torch.cuda.is_available()):
            buf = aligned_empty(int(numel), dtype)
            self.track(purpose, buf.numel() * buf.element_size())
            return buf
        return super().empty(numel, dtype, purpose)

    def optimizer_stepper(self) -> Callable[["FusedCPUOptimizer"], None]:
        """:meth:`step_optimizer`, which the partitioner calls in place of ``optimizer.step()``."""
        return self.step_optimizer

    def step_optimizer(self, optimizer: "FusedCPUOptimizer", grad_factor: float = 1.0) -> None:
        """Step a fused CPU optimizer with its state on NVMe: the parameters are packed into
        sub-groups of ``sub_group_size`` elements whose state is read into host buffers, stepped
        and written back, overlapping the I/O of neighbouring sub-groups with the update. Between
        steps ``optimizer.state`` is a :class:`~zkit_offload.swapped_state.SwappedState` (only
        ``step`` in memory). Check overflow first (``optimizer.grad_stats``): a sub-group
        pipeline cannot be rolled back half-way. With only the parameters on NVMe (optimizer
        state in memory) this is a plain ``optimizer.step()``."""
        if self.swapper is None:
            optimizer.step()
            return
        state = self._swapped_state(optimizer)
        plan = state.plan
        group_of = state.groups_by_param(optimizer)

        def step(i: int, tensors: dict[str, torch.Tensor]) -> None:
            state.bind(i, tensors, optimizer, group_of)
            stepped = [p for p, _ in plan.members[i] if p.grad is not None]
            if stepped:
                optimizer.fused_step(grad_factor, params=stepped)
            state.unbind(i)  # the buffers are reused by the next sub-groups

        fresh = set(range(len(plan))) - state.on_disk
        with state.raw():
            self.step_in_subgroups(plan.subgroups(), step, fresh=fresh)
        state.on_disk.update(range(len(plan)))

    def master_store(self, shard_sizes: Sequence[int]) -> SwappedMasterStore | None:
        """Stages 2-3 with ``offload_optimizer.device == "nvme"``: a
        :class:`~zkit_offload.swapped_master.SwappedMasterStore` keeping the fp32 master and its
        gradients on NVMe with the optimizer state (``shard_sizes``: elements per unit's shard);
        otherwise ``None`` (the master stays in host memory)."""
        if self.swapper is None:
            return super().master_store(shard_sizes)
        if self._master_store is not None:
            raise ValueError("this NVMe allocator already holds the master of one partitioner")
        self._master_store = SwappedMasterStore(self, shard_sizes, self.sub_group_size)
        return self._master_store

    def check_optimizer(self, optimizer: torch.optim.Optimizer, name: str) -> None:
        """With the optimizer state on NVMe, the optimizer must step sub-group by sub-group between
        swaps: only zkit-offload's fused CPU optimizers can."""
        from zkit_offload.cpu_optimizer import FusedCPUOptimizer

        if self.swapper is not None and not isinstance(optimizer, FusedCPUOptimizer):
            raise ValueError(
                f"optimizer {name!r} ({type(optimizer).__name__}) cannot run with "
                "zero_optimization.offload_optimizer.device 'nvme': the state swapped from NVMe is stepped sub-group "
                "by sub-group, which only zkit-offload's fused CPU optimizers do (cpu_adam, cpu_adamw, cpu_adagrad, "
                f"cpu_lion; config types Adam, AdamW, Adagrad, Lion). {type(optimizer).__name__} has no sub-group "
                "step. Use one of those, or offload_optimizer.device 'cpu', which steps any optimizer in host memory"
            )

    def _swapped_state(self, optimizer: "FusedCPUOptimizer", plan: SubGroupPlan | None = None) -> SwappedState:
        """``optimizer.state`` as a :class:`SwappedState`, installed on the first step (and again
        after ``optimizer.load_state_dict``, which replaces it with a plain dict). ``plan``: the
        sub-group layout to use (default: the parameters packed by ``sub_group_size``)."""
        self.check_optimizer(optimizer, type(optimizer).__name__)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        state = optimizer.state
        if isinstance(state, SwappedState):
            if not state.plan.matches(params):
                raise ValueError("the NVMe-offloaded optimizer's parameters changed after its first step; "
                                 "build a new optimizer (and engine) for a different set of parameters")
            return state
        if self._plan is None:
            self._plan = plan or SubGroupPlan(params, optimizer._state_names, self.sub_group_size)
        elif not self._plan.matches(params):
            raise ValueError("step_optimizer: this NVMe allocator swaps the state of one optimizer; got another "
                             "one (different parameters)")
        swapped = SwappedState(self._plan, self.swapper, resident=state)
        optimizer.state = swapped
        return swapped

    def step_in_subgroups(self, subgroups: Sequence[Mapping[str, int]],
                          step: Callable[[int, dict[str, torch.Tensor]], None],
                          fresh: bool | Container[int] | None = None, fresh_names: Container[str] | None = None,
                          read_only: Container[str] = ()) -> None:
        """Call ``step(i, tensors)`` for each sub-group (``{name: numel}``) with its swapped
        tensors in host buffers, reading ahead and writing behind (buffer_count buffer sets).
        ``fresh``: sub-groups that start zero-filled (no read); by default those never written;
        ``fresh_names`` and ``read_only`` as in :func:`~zkit_offload.pipeline.step_in_subgroups`."""
        buffers = self.subgroup_buffers(subgroups)
        if fresh is None:
            fresh = set(range(len(subgroups))) - self._stepped
        step_in_subgroups(self.swapper, subgroups, step, buffers, fresh=fresh, fresh_names=fresh_names,
                          read_only=read_only)
        self._stepped.update(range(len(subgroups)))

    def subgroup_buffers(self, subgroups: Sequence[Mapping[str, int]]) -> SubGroupBuffers:
        """The ``buffer_count`` host buffer sets that sub-groups (``{name: numel}``) stream through
        (made once), with a swap file registered for each of their tensors."""
        if self._buffers is None:
            self._buffers = SubGroupBuffers(subgroups, max(2, self.optimizer_config.buffer_count))
            self.track("optim_state", sum(t.numel() * t.element_size() for s in self._buffers.sets for t in s.values()))
        # Every file exists, at full size, before the first sub-group steps: a full disk stops the
        # first step before it changes anything, instead of half-way through it.
        known = set(self.swapper.keys())
        for i, sg in enumerate(subgroups):
            for name, n in sg.items():
                if subgroup_key(i, name) not in known:
                    self.swapper.register(subgroup_key(i, name), n * self._buffers.sets[0][name].element_size())
        return self._buffers

    def close(self) -> None:
        """Finish pending writes, delete the swap files and stop the I/O threads."""
        try:
            super().close()
            if isinstance(self._master_store, SwappedMasterStore):
                self._master_store.flush()
            for store in self._param_stores:
                store.flush()
        finally:
            for swapper in (self.swapper, self.param_swapper):
                if swapper is not None:
                    swapper.close()
