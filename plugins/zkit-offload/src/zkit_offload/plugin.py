"""zkit plugin entry point of zkit-offload: the hook implementations zkit discovers.

Kept light: the optimizer and allocator modules (and Numba) load only when a record's factory
runs, so an installed but unused plugin costs nothing at start-up.
"""
from __future__ import annotations

from typing import Any

import zkit
from zkit.core.records import AllocatorRecord, ConfigSectionRecord, OptimizerRecord

from zkit_offload.io_memory import ALIGN_ELEMS
from zkit_offload.config import (AioConfig, OffloadOptimizerConfig, OffloadParamConfig, check_step_in_backward,
                                 check_supported)

#: Config optimizer types (lower case) and the CPU optimizer that replaces each under offload.
CPU_OPTIMIZER_FOR = {"adam": "cpu_adam", "adamw": "cpu_adamw", "adagrad": "cpu_adagrad", "lion": "cpu_lion",
                     "cpu_adam": "cpu_adam", "cpu_adamw": "cpu_adamw", "cpu_adagrad": "cpu_adagrad",
                     "cpu_lion": "cpu_lion", "deepspeedcpuadam": "cpu_adam"}


def _offloaded_adam(kind: str, param_groups, params: dict[str, Any]):
    """The CPU Adam for a config's ``kind`` (``"adam"``/``"adamw"``): the same settings and
    defaults as without offload (``zkit.optim.plugin.adam_settings``: ``"Adam"`` is AdamW
    unless ``adam_w_mode`` is false; ``weight_decay`` defaults to 0), so offloading never changes
    what the optimizer computes."""
    from zkit.optim import adam_settings
    from zkit_offload.cpu_adam import CPUAdam, CPUAdamW

    params = dict(params)
    backend = params.pop("backend", "auto")  # the CPU Adam's own key (numba or torch kernels)
    decoupled, kwargs = adam_settings(kind, params)
    kwargs.pop("fused"), kwargs.pop("foreach")  # torch's kernel choice: the CPU Adam is one fused pass anyway
    if kwargs.pop("maximize"):
        raise ValueError(f"optimizer {kind!r}: maximize=true is not supported with offload_optimizer "
                         "(the CPU Adam minimises)")
    if decoupled:
        return CPUAdamW(param_groups, backend=backend, **kwargs)
    return CPUAdam(param_groups, adamw_mode=False, backend=backend, **kwargs)


def _cpu_adam(param_groups, **params):
    # DeepSpeed's "DeepSpeedCPUAdam"/"cpu_adam" takes adamw_mode (default true) as well as adam_w_mode
    if "adamw_mode" in params:
        params["adam_w_mode"] = params.pop("adamw_mode")
    return _offloaded_adam("adam", param_groups, params)


def _cpu_adamw(param_groups, **params):
    return _offloaded_adam("adamw", param_groups, params)


def _cpu_adagrad(param_groups, **params):
    from zkit_offload.cpu_adagrad import CPUAdagrad

    return CPUAdagrad(param_groups, **params)


def _cpu_lion(param_groups, **params):
    from zkit_offload.cpu_lion import CPULion

    return CPULion(param_groups, **params)


def _host_allocator(device, config):
    from zkit_offload.allocators import HostAllocator

    return HostAllocator(device, config)


def _nvme_allocator(device, config):
    from zkit_offload.allocators import NVMeAllocator

    return NVMeAllocator(device, config)


@zkit.hookimpl
def zkit_register_optimizers():
    cpu = ("cpu",)
    yield OptimizerRecord(name="cpu_adam", aliases=("deepspeedcpuadam",), devices=cpu,
                          state_names=("exp_avg", "exp_avg_sq"), factory=_cpu_adam, state_format="adam",
                          description="Adam (AdamW with adamw_mode) fused in one multi-threaded Numba pass")
    yield OptimizerRecord(name="cpu_adamw", devices=cpu, state_names=("exp_avg", "exp_avg_sq"), state_format="adam",
                          factory=_cpu_adamw, description="AdamW fused in one multi-threaded Numba pass")
    yield OptimizerRecord(name="cpu_adagrad", devices=cpu, state_names=("sum",), factory=_cpu_adagrad,
                          description="Adagrad fused in one multi-threaded Numba pass")
    yield OptimizerRecord(name="cpu_lion", devices=cpu, state_names=("exp_avg",), factory=_cpu_lion,
                          description="Lion fused in one multi-threaded Numba pass")


@zkit.hookimpl
def zkit_register_allocators():
    yield AllocatorRecord(name="host", factory=_host_allocator,
                          description="master weights, their gradients and optimizer state in (pinned) host memory")
    yield AllocatorRecord(name="nvme", factory=_nvme_allocator, align_elems=ALIGN_ELEMS,
                          description="host allocator with optimizer state and/or stage-3 parameter shards "
                                      "swapped to NVMe files")


@zkit.hookimpl
def zkit_config_sections():
    yield ConfigSectionRecord(path=OffloadOptimizerConfig.SECTION, schema=OffloadOptimizerConfig,
                              description="offload optimizer state and master weights to cpu or nvme")
    yield ConfigSectionRecord(path=OffloadParamConfig.SECTION, schema=OffloadParamConfig,
                              description="offload stage-3 parameter shards to cpu or nvme")
    yield ConfigSectionRecord(path=AioConfig.SECTION, schema=AioConfig, description="NVMe swapper I/O settings")


def choose_stack(optimizer_section: OffloadOptimizerConfig | None, aio: AioConfig | None,
                 optimizer_type: str | None, param_section: OffloadParamConfig | None = None,
                 stage: int | None = None) -> Any:
    """The :class:`zkit.Stack` an offload config needs, or ``None`` without offload.

    ``offload_optimizer`` picks the CPU optimizer; either section on ``nvme`` picks the ``nvme``
    allocator, otherwise either on ``cpu`` the ``host`` allocator. ``offload_param`` needs
    ``stage`` 3 (the only stage whose parameters are partitioned)."""
    optimizer_section = optimizer_section or OffloadOptimizerConfig()
    param_section = param_section or OffloadParamConfig()
    devices = (optimizer_section.device, param_section.device)
    if devices == ("none", "none"):
        return None
    check_supported(optimizer_section, aio or AioConfig())
    if param_section.device != "none" and stage is not None and stage < 3:
        raise ValueError(
            f"zero_optimization.offload_param (device {param_section.device!r}) needs ZeRO stage 3, the stage that "
            f"partitions parameters; this config has stage {stage}. Set zero_optimization.stage to 3, or use "
            "offload_optimizer to offload optimizer state at stages 1-2"
        )
    allocator = "nvme" if "nvme" in devices else "host"
    optimizer = None
    if optimizer_type is not None and optimizer_section.device != "none":
        key = optimizer_type.strip().lower()
        if key in CPU_OPTIMIZER_FOR:
            optimizer = CPU_OPTIMIZER_FOR[key]
        elif optimizer_section.device == "nvme":
            # the same refusal a Stack-chosen optimizer meets at initialize (NVMeAllocator.check_optimizer)
            raise ValueError(
                f"optimizer {optimizer_type!r} cannot run with zero_optimization.offload_optimizer.device 'nvme': the "
                "state swapped from NVMe is stepped sub-group by sub-group, which only zkit-offload's fused CPU "
                "optimizers do (config types Adam, AdamW, Adagrad, Lion). Use one of those, or offload_optimizer.device "
                "'cpu', which steps any optimizer in host memory"
            )
        # on "cpu" another optimizer steps the host-resident master itself, as it would by a Stack
    asked = ", ".join(f"{section} device {device!r}" for section, device in
                      zip(("zero_optimization.offload_optimizer", "zero_optimization.offload_param"), devices)
                      if device != "none")
    return zkit.Stack(allocator=allocator, optimizer=optimizer, reason=asked)


@zkit.hookimpl
def zkit_configure(config):
    optimizer = getattr(config, "optimizer", None)
    zero = config.section("zero_optimization")  # None with zkit.zero's plugin blocked
    offload_optimizer = config.section(OffloadOptimizerConfig.SECTION)
    check_step_in_backward(offload_optimizer or OffloadOptimizerConfig(), getattr(zero, "stage", None),
                           config.gradient_clipping, config.fp16.enabled)
    return choose_stack(
        offload_optimizer,
        config.section(AioConfig.SECTION),
        getattr(optimizer, "type", None) if optimizer is not None else None,
        config.section(OffloadParamConfig.SECTION),
        getattr(zero, "stage", None),
    )


@zkit.hookimpl
def zkit_before_backward(micro_step, boundary):
    """``offload_optimizer.step_in_backward``: before the backward that ends a batch, the master
    store starts stepping each sub-group (NVMe, :mod:`zkit_offload.backward_step`) or unit (host
    memory, :mod:`zkit_offload.host_master`) as its gradients complete; the partitioner's ``step``
    then finishes that step. The host store's masters stay put, so its units return without a
    wait (``publish_unit``), or are written by the step itself where the parameters are 16-bit in
    host memory; the NVMe store reuses its buffers (``publish_from_buffer``)."""
    store = getattr(micro_step.allocator, "master_store_made", None)
    if boundary and store is not None and store.step_in_backward:
        from zkit_offload.host_master import HostMasterStore

        partitioner = micro_step.partitioner
        if isinstance(store, HostMasterStore):
            store.begin_last_backward(partitioner.optimizer, partitioner.owned, partitioner.publish_unit,
                                      partitioner.publish_target)
        else:
            store.begin_last_backward(partitioner.optimizer, partitioner.owned, partitioner.publish_from_buffer)


@zkit.hookimpl
def zkit_report():
    yield "zkit-offload", "installed"
    try:
        from zkit_offload import kernels
        from zkit_offload.numba_setup import CACHE_DIR

        import numba

        yield "zkit-offload numba", (f"numba {numba.__version__}, threading layer "
                                     f"{numba.config.THREADING_LAYER}, {numba.config.NUMBA_NUM_THREADS} threads, "
                                     f"cache {CACHE_DIR}, hardware fp16 conversion {kernels.HARDWARE_HALF}")
    except Exception as exc:  # report why the CPU optimizers cannot run here
        yield "zkit-offload numba", f"unavailable: {exc}"
