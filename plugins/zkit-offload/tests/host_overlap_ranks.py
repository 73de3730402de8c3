"""Rank functions for the overlapped ZeRO-Offload tests (``offload_optimizer.step_in_backward``
with device ``cpu``; module level: ranks are spawned processes)."""
from __future__ import annotations

import contextlib

import torch

import zkit

import offload_ranks as orr


def overlap_config(stage: int, dtype: str, world: int, overlapped: bool, gas: int = 1, **extra) -> dict:
    """``offload_ranks.config`` with the optimizer on ``cpu`` and ``gas`` micro-batches of ``2 // gas``
    rows per step (the same global batch for every ``gas``)."""
    cfg = orr.config(stage, dtype, world, "cpu", micro=2 // gas, gradient_accumulation_steps=gas, **extra)
    cfg["zero_optimization"]["offload_optimizer"]["step_in_backward"] = overlapped
    return cfg


def train(engine, steps: int, gas: int, nonfinite_at: int | None) -> dict:
    """``steps`` batches of ``gas`` micro-steps. At batch ``nonfinite_at`` the embedding's gradient
    (the last to complete in backward, so the units before it have stepped by then) is NaN on rank
    0 only: every rank must skip that step, the other ranks learning it from the verdict's
    all-reduce. Whether each batch's step began in backward, the losses, and the steps applied."""
    world, rank = engine.world_size, engine.rank
    micro = 2 // gas
    ids, labels = orr.global_batches(steps * gas, micro * world)
    poison = {"on": False}
    embed = engine.module.embed.weight
    embed.register_hook(lambda g: g * float("nan") if poison["on"] else g)
    store = engine.partitioner.master_store
    began, losses, applied = [], [], []
    for i in range(steps * gas):
        poison["on"] = rank == 0 and i // gas == nonfinite_at
        first = (i * world + rank) * micro
        loss = engine(ids[first : first + micro], labels[first : first + micro])
        engine.backward(loss)
        if (i + 1) % gas == 0:
            began.append(bool(getattr(store, "stepped_in_backward", False)))
            engine.step()
            applied.append(bool(engine.was_step_applied()))
        else:
            engine.step()
        losses.append(loss.item())
    return {"began": began, "losses": losses, "applied": applied}


@contextlib.contextmanager
def grads_beside_master():
    """The host allocator answers ``grads_beside_master()`` as with an accelerator: the reduced
    chunks go to fp32 host shards beside the master, later micro-steps added there (on a CPU-only
    machine they accumulate in the training dtype instead). The overlapped store takes them that
    way, so this is the step it overlaps."""
    from zkit_offload.allocators import HostAllocator

    HostAllocator.grads_beside_master = lambda self: True
    try:
        yield
    finally:
        del HostAllocator.grads_beside_master


def equivalence(cases: list[tuple], steps: int = 3) -> dict:
    """Per (stage, dtype, gas, gradient NaN at batch or None): the final parameters, optimizer
    state, losses and verdicts of the run stepping after backward (gradients beside the master, as
    with an accelerator) and of the run stepping in it."""
    world = torch.distributed.get_world_size()
    out = {}
    for stage, dtype, gas, nonfinite_at in cases:
        for overlapped in (False, True):
            with contextlib.nullcontext() if overlapped else grads_beside_master():
                engine, *_ = zkit.initialize(model=orr.make_model(),
                                             config=overlap_config(stage, dtype, world, overlapped, gas))
            result = train(engine, steps, gas, nonfinite_at)
            result["params"] = orr.params_of(engine)
            opt = engine.partitioner.optimizer
            result["state"] = [t.clone() for p in opt.param_groups[0]["params"] for t in opt.state[p].values()]
            result["store"] = type(engine.partitioner.master_store).__name__
            engine.close()
            out[(stage, dtype, gas, nonfinite_at, overlapped)] = result
    return out


def ordered_under_fake_streams(dtype: str, steps: int = 2) -> dict:
    """One rank, every host<->device copy deferred to a fake side stream until its event is waited
    (:mod:`zkit.fake_streams`), the host steps run on the caller's thread as they are handed over:
    per batch, the order of what happened to each unit (its gradient's copy issued, its host step
    with how many side-stream copies had run by then, its parameters' copy issued), and the
    final parameters, against the same run stepping after backward without fake streams."""
    from zkit.fake_streams import installed
    from zkit_offload.host_master import HostStepper

    plain, *_ = zkit.initialize(model=orr.make_model(), config=overlap_config(2, dtype, 1, False))
    plain_losses = [loss for step in range(steps) for loss in orr.train(plain, 1, 2, start=step)]
    plain_params = orr.params_of(plain)
    plain.close()
    with installed() as made:
        engine, *_ = zkit.initialize(model=orr.make_model(), config=overlap_config(2, dtype, 1, True))
        (streams,) = made
        store = engine.partitioner.master_store
        store.stepper = HostStepper(threaded=False)
        events: list[tuple] = []
        shared = store.master_is_param

        def listen(event, unit):
            if event == "step":  # with how many side-stream copies had run by then
                events.append(("step", unit, streams.ran))
            else:  # a gradient's copy or the parameters' is the next one issued (none when shared)
                events.append((event, unit, None if shared else streams.issued))

        store.listener = listen
        # when backward reaches the embedding lookup, its last op: units handed over before that
        # were handed over while backward ran, not at its end
        def mark(module, args, out) -> None:
            out.register_hook(lambda grad: events.append(("embedding", -1, None)))

        engine.module.embed.register_forward_hook(mark)
        batches = []
        losses = []
        for step in range(steps):
            events.clear()
            losses += orr.train(engine, 1, 2, start=step)
            batches.append(list(events))
        params = orr.params_of(engine)
        units = len(store.shard_sizes)
        copy_out, in_place = store.copy_out, store.master_is_param
        copies = streams.issued
        engine.close()
    return {"batches": batches, "units": units, "copy_out": copy_out, "in_place": in_place, "copies": copies,
            "losses": losses, "params": params,
            "plain_losses": plain_losses, "plain_params": plain_params}


def refusal(change: dict) -> str:
    """The error ``initialize`` raises for the one-rank overlapped config with ``change`` applied
    (dotted keys)."""
    cfg = overlap_config(2, "fp32", 1, True)
    for key, value in change.items():
        *path, last = key.split(".")
        section = cfg
        for name in path:
            section = section[name]
        section[last] = value
    try:
        with contextlib.closing(zkit.initialize(model=orr.make_model(), config=cfg)[0]):
            return "accepted"
    except Exception as exc:  # noqa: BLE001 - the text is what is checked
        return str(exc)
