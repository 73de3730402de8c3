"""Rank function of the composition matrix (tests/test_composition.py)."""
from __future__ import annotations

import traceback
from pathlib import Path

import torch

import composition as matrix
from composition_models import batch, build, is_pipeline, micro_step_loss, named_params

STEPS = 3


def between_steps(engine, features: tuple[str, ...], run: dict | None) -> None:
    """What a cell does between two steps: with ``offload_states``, move the engine's states off
    its device and back, recording in ``run`` the kinds and bytes that were away."""
    if "offload_states" not in features:
        return
    from zkit.zero.offload_states import held

    engine.offload_states()
    away = held(engine.partitioner)
    if run is not None:
        emptied = all(m.storage.nbytes() == 0 for m in away.moved)
        run.setdefault("offloaded", []).append((engine.partitioner.offloaded_states(), away.nbytes(), emptied))
    engine.reload_states()


def _train(engine, features: tuple[str, ...], cfg: dict, steps: range, run: dict | None = None) -> None:
    micro, accum = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    replicas = matrix.replicas(features)
    replica = 0 if replicas == 1 else torch.distributed.get_rank() % replicas
    if "pipeline_dp" in features:
        replica = engine.module.grid.coord(torch.distributed.get_rank()).data
    rows = 4 // replicas
    for step in steps:
        x, y = batch(step, features)
        x = x if x.dtype == torch.long else x.to(engine.dtype)
        mine_x, mine_y = x[rows * replica: rows * (replica + 1)], y[rows * replica: rows * (replica + 1)]
        batches = [(mine_x[i:i + micro], mine_y[i:i + micro]) for i in range(0, rows, micro)]
        assert len(batches) == accum
        if is_pipeline(features):
            engine.train_batch(iter(batches))
        else:
            for xs, ys in batches:
                engine.backward(micro_step_loss(engine, features, xs, ys))
                engine.step()
        between_steps(engine, features, run)


class CountingAllocator:
    """A third-party allocator: zkit's flat device buffers, counting what it hands out."""

    handed_out = 0  # buffers handed out in this process, by every Counting allocator

    @staticmethod
    def record():
        from zkit.core.allocator import Allocator
        from zkit.core.records import AllocatorRecord

        class Counting(Allocator):
            def place(self, purpose: str) -> torch.device:
                return self.device

            def empty(self, numel: int, dtype: torch.dtype, purpose: str) -> torch.Tensor:
                CountingAllocator.handed_out += 1
                return super().empty(numel, dtype, purpose)

        return AllocatorRecord(name="counting", factory=lambda device, config: Counting(device), dist="third-party")


#: the 1-bit communicator of ``onebit_comm`` compresses tensors of this many elements and more (its
#: default, 4096, is above every gradient bucket of these tiny models: nothing would be compressed)
ONEBIT_MIN_NUMEL = 32


def onebit_record():
    """zkit-onebit's communicator with :data:`ONEBIT_MIN_NUMEL`, as a record a Stack can take."""
    from zkit.core.records import CommunicatorRecord
    from zkit_onebit import OneBitCommunicator

    def factory(group, config, transport):
        return OneBitCommunicator(transport, min_numel=ONEBIT_MIN_NUMEL)

    # compresses the data-parallel gradients only: every other group gets the torch transport
    return CommunicatorRecord(name="onebit-small", factory=factory, wraps="torch", dist="tests")


def _engine(features: tuple[str, ...], cfg: dict, run: dict | None = None, model=None, **kwargs):
    """The engine of a cell; ``run`` collects what the evidence checks read (composition_evidence)."""
    import zkit
    from composition_evidence import RecomputeCounter, RegionCountingBackend

    model = build(features) if model is None else model
    run = {} if run is None else run
    run["recompute"] = RecomputeCounter(model)
    run["compresses"] = matrix.compresses(features)
    run["untraceable_blocks"] = bool(set(matrix.UNTRACEABLE_BLOCKS) & set(features))
    run["replicas"] = matrix.reduced_over(features)  # the ranks gradients are reduced over
    run["accum_base"] = matrix.config(tuple(f for f in features if f != "grad_accum"), "")[
        "gradient_accumulation_steps"]
    if "client_sgd" in features:
        kwargs["optimizer"] = torch.optim.SGD(kwargs.pop("model_parameters", model.parameters()), lr=1e-2,
                                              momentum=0.9)
    stack = {}
    if "custom_allocator" in features:
        stack["allocator"] = CountingAllocator.record()
        start = CountingAllocator.handed_out
        run["allocated"] = lambda: CountingAllocator.handed_out - start
    if "onebit_comm" in features:
        stack["communicator"] = onebit_record()
    if "custom_comm" in features:
        from composition_comm import CountingCommunicator, record

        stack["communicator"] = record()
        start = len(CountingCommunicator.built)
        run["comm_built"] = lambda: CountingCommunicator.built[start:]
    if stack:
        kwargs["stack"] = zkit.Stack(**stack)
    engine, *_ = zkit.initialize(model=model, config=cfg, **kwargs)
    if "overlap_gather" in features:
        count_gathers(engine, run)
    if "cpu_step_in_backward" in features:
        count_host_steps(engine, run)
    if "comm_bf16" in features:
        record_reduced_dtypes(engine, run)
    if "compile" in features:
        import torch._dynamo as dynamo

        # the cells of one process compile the same forwards: past Dynamo's recompile limit for a
        # code object, a forward would run uncompiled and the cell would test nothing
        dynamo.reset()
        backend = RegionCountingBackend()
        try:
            engine.compile(backend=backend)
        except Exception:
            engine.close()  # refused before any step: the engine must not outlive the refusal
            raise
        # both engines of a checkpoint cell: the loading one takes one step, which the engine's FLOP
        # probe runs eagerly (zkit.core.compile)
        run.setdefault("backends", []).append(backend)
        # stage 3 compiles block by block (Stage3.compile_regions), inside the model's checkpoints
        run["regional"] = getattr(getattr(engine, "partitioner", None), "stage", None) == 3
    return engine, model


def record_reduced_dtypes(engine, run: dict) -> None:
    """Record in ``run`` the dtype of every gradient reduction (a reduction keyed ``grad/<unit>``
    by the partitioner) of every engine of the cell, as the engine's communicator is handed it."""
    partitioner = getattr(engine, "partitioner", None)
    comm = getattr(partitioner, "comm", None)
    dtypes = run.setdefault("reduced_dtypes", [])
    run.setdefault("comm_dtypes", []).append(getattr(partitioner, "comm_dtype", None))
    if comm is None:
        return
    for kind, tensor_at in (("all_reduce", 0), ("reduce_scatter", 1)):
        def spied(*args, _call=getattr(comm, kind), _at=tensor_at, **kwargs):
            if str(kwargs.get("key") or "").startswith("grad/"):
                dtypes.append(args[_at].dtype)
            return _call(*args, **kwargs)

        setattr(comm, kind, spied)  # on the instance: whatever communicator the stack chose


def count_host_steps(engine, run: dict) -> None:
    """Count in ``run`` the units each engine of the cell stepped during a batch's last backward
    (ZeRO-Offload overlapped: the host store's listener hears ``"step"`` for those only)."""
    counts = {"units": 0}
    run.setdefault("host_steps", []).append(counts)
    store = getattr(getattr(engine, "partitioner", None), "master_store", None)
    if store is None or not hasattr(store, "listener"):
        return

    def heard(event: str, unit: int) -> None:
        counts["units"] += event == "step"

    store.listener = heard


def count_gathers(engine, run: dict) -> None:
    """Count in ``run`` the units all-gathered in the background (``overlap_param_gather``), those
    waited for, and the waits for one unit at its first use in a forward, over every engine of the
    cell (a loading engine waits for its gathers at the load); ``refresh`` says per engine whether
    it gathers in the background."""
    refresh = getattr(getattr(engine, "partitioner", None), "refresh", None)
    counts = run.setdefault("gathers", {"background": 0, "waited": 0, "first_use": 0, "refresh": []})
    counts["refresh"].append(refresh is not None)
    if refresh is None:
        return
    start, wait = refresh.start, refresh.wait

    def counted_start(launch_all):
        start(launch_all)
        counts["background"] += len(refresh.pending)

    def counted_wait(unit=None):
        pending = len(refresh.pending)
        if unit is not None and unit in refresh.pending:  # a parameter of the unit reached a torch call
            counts["first_use"] += 1
        wait(unit)
        counts["waited"] += pending - len(refresh.pending)

    refresh.start, refresh.wait = counted_start, counted_wait


def save(engine, where: str, *, dcp: bool, run: dict) -> str:
    """Save the engine's checkpoint at ``where``; with ``dcp``, also as a DCP directory beside it
    (written by rank 0 from the checkpoint's files, what ``zkit export --format dcp`` does): the
    directory to load from. A rank whose export failed makes every rank raise."""
    engine.save_checkpoint(where)
    if not dcp:
        return where
    from zkit.checkpoint.dcp import write_dcp
    from zkit.checkpoint import formats

    out, error = f"{where}-dcp", [None]
    if torch.distributed.get_rank() == 0:
        try:
            write_dcp(where, out)
        except Exception as exc:  # noqa: BLE001 - handed to every rank below
            error = [f"{type(exc).__name__}: {exc}"]
    torch.distributed.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise RuntimeError(error[0])
    found = formats.for_load(engine.pm, Path(out), None)
    run["dcp_format"] = getattr(found, "name", None)
    return out


def _run(features: tuple[str, ...], nvme_path: str, ckpt_root: str) -> dict:
    from composition_evidence import missing

    cfg = matrix.config(features, nvme_path)
    run: dict = {}
    try:
        engine, model = _engine(features, cfg, run)
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return {"refused": f"{type(exc).__name__}: {exc}"}
    try:
        if "save_load" not in features and "dcp_checkpoint" not in features:
            _train(engine, features, cfg, range(STEPS), run)
        else:  # train, save, and go on in a new engine that loads the checkpoint
            _train(engine, features, cfg, range(STEPS - 1), run)
            where = f"{ckpt_root}/{'-'.join(features)}"
            try:  # refusing to save, or to load what was saved, is not silent either
                where = save(engine, where, dcp="dcp_checkpoint" in features, run=run)
                engine.close()
                engine, model = _engine(features, cfg, run)
                engine.load_checkpoint(where)
            except Exception as exc:  # noqa: BLE001 - the refusal is the result
                return {"refused_checkpoint": f"{type(exc).__name__}: {exc}"}
            run["loaded_steps"] = engine.global_steps
            _train(engine, features, cfg, range(STEPS - 1, STEPS), run)
        return {"params": named_params(model), "missing": missing(features, engine, model, run)}
    except Exception:  # noqa: BLE001 - a crash after initialize is what the matrix must not have
        return {"crashed": traceback.format_exc(limit=8)}
    finally:
        engine.close()


def run_cells(cells: list[tuple[str, ...]], nvme_path: str, ckpt_root: str) -> dict:
    """Every cell (a tuple of features) in one process group, in order."""
    return {cell: _run(cell, nvme_path, ckpt_root) for cell in cells}


def run_matrix(cells: list[tuple[str, ...]], nvme_path: str, ckpt_root: str) -> dict:
    """Every cell: those of 2 ranks in one process group, those of 4 in another, of 8 in a third."""
    from zkit.testing import run_ranks

    out = {}
    for world in (2, 4, 8):
        group = [c for c in cells if matrix.ranks(c) == world]
        out.update(run_ranks(run_cells, world, args=(group, nvme_path, ckpt_root), timeout=900)[0])
    return out
