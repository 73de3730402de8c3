"""zkit plugin entry point of zkit-onebit: the hook implementations zkit discovers."""
from __future__ import annotations

from typing import Any

import zkit
from zkit.core.records import CommunicatorRecord, OptimizerRecord
from zkit_onebit import __version__
from zkit_onebit.adam import OneBitAdam, make_onebit_adam
from zkit_onebit.communicator import OneBitCommunicator, make_onebit_communicator
from zkit_onebit.zeroone_adam import make_zero_one_adam


@zkit.hookimpl
def zkit_register_communicators():
    yield CommunicatorRecord(
        name="onebit",
        factory=make_onebit_communicator,
        wraps="torch",
        description="1-bit error-feedback compressed all-reduce/reduce-scatter over torch.distributed",
        aliases=("1bit", "onebit_compressed"),
    )


@zkit.hookimpl
def zkit_register_optimizers():
    yield OptimizerRecord(
        name="onebitadam",
        aliases=("onebit_adam", "1bitadam"),
        factory=make_onebit_adam,
        description="1-bit Adam: Adam warm-up, then frozen variance and 1-bit compressed exchange",
        state_names=("exp_avg", "exp_avg_sq"),
        elementwise=True,
        devices=("cpu", "cuda"),
        communicator="onebit",  # ZeRO 1-2 reduce gradients through it, 1-bit after freeze_step
        needs_communicator=True,  # the compressed momenta of ZeRO 0
    )
    yield OptimizerRecord(
        name="zerooneadam",
        aliases=("zero_one_adam", "01adam"),
        factory=make_zero_one_adam,
        description="0/1 Adam: variance refreshed on a thinning schedule, 1-bit gradients, then local steps (ZeRO 0)",
        state_names=("exp_avg", "exp_avg_sq", "sync_params"),
        elementwise=True,
        devices=("cpu", "cuda"),
        needs_communicator=True,
    )


def _find(obj: Any, cls: type, depth: int = 3) -> Any:
    """``obj`` or the object it wraps (``.optimizer``) that is a ``cls``."""
    for _ in range(depth):
        if obj is None or isinstance(obj, cls):
            return obj
        obj = getattr(obj, "optimizer", None)
    return obj if isinstance(obj, cls) else None


def onebit_optimizer(holder: Any) -> OneBitAdam | None:
    """The 1-bit optimizer (OneBitAdam or ZeroOneAdam, a subclass) of an engine or of a step's
    partitioner, if it has one."""
    found = _find(getattr(holder, "optimizer", None), OneBitAdam)
    if found is None:
        found = _find(getattr(getattr(holder, "partitioner", None), "optimizer", None), OneBitAdam)
    return found


def _engine_comm(engine: Any) -> Any:
    comm = getattr(engine, "comm", None)
    return comm if comm is not None else getattr(getattr(engine, "partitioner", None), "comm", None)


@zkit.hookimpl
def zkit_engine_setup(engine):
    opt = onebit_optimizer(engine)
    if opt is None:
        return
    opt.attach(engine.partitioner)  # its communicator came through the record's factory


@zkit.hookimpl(wrapper=True, trylast=True)
def zkit_grad_norm(step):
    """While a 1-bit optimizer has gradient reduction off (ZeRO 0 after the freeze), each rank
    holds its local gradients only: the norm every rank uses for fp16 overflow checks and clipping
    is the root mean square of the local norms (an exact scalar all-reduce), so that no rank skips
    a step or clips differently while the others enter the compressed exchange."""
    norm = yield
    comm = step.comm
    if step.partitioner.gradient_reduction or comm.world_size == 1 or onebit_optimizer(step) is None:
        return norm
    sq = norm.detach().float().reshape(1).square()
    comm.all_reduce(sq, "sum")
    return sq.div_(comm.world_size).sqrt_().reshape(())


@zkit.hookimpl
def zkit_after_backward(micro_step):
    # The partitioner's reductions of this backward are done: the next ones start a new round.
    seen = set()
    for comm in (micro_step.comm, getattr(micro_step.partitioner, "comm", None)):
        if isinstance(comm, OneBitCommunicator) and id(comm) not in seen:
            seen.add(id(comm))
            comm.end_round()


@zkit.hookimpl
def zkit_checkpoint_save(engine):
    out: dict[str, Any] = {}
    opt = onebit_optimizer(engine)
    if opt is not None:
        out["optimizer"] = opt.onebit_state_dict()
    comm = _engine_comm(engine)
    if isinstance(comm, OneBitCommunicator) and (opt is None or comm is not opt._grad_comm):
        out["communicator"] = comm.state_dict()
    return out or None


@zkit.hookimpl
def zkit_checkpoint_load(engine, state):
    opt = onebit_optimizer(engine)
    if opt is not None and "optimizer" in state:
        opt.load_onebit_state_dict(state["optimizer"])
    comm = _engine_comm(engine)
    if isinstance(comm, OneBitCommunicator) and "communicator" in state:
        comm.load_state_dict(state["communicator"])


@zkit.hookimpl
def zkit_report():
    yield "zkit-onebit", (
        f"{__version__}: communicator 'onebit' (1-bit error-feedback all-reduce), optimizer 'onebitadam' "
        f"(ZeRO stages 0-2), 'zerooneadam' (ZeRO stage 0)"
    )
