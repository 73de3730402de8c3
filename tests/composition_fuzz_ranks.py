"""Rank function of the composition fuzzer: runs feature sets of composition_fuzz_model.py, many in
one process group (tests/composition_fuzz.py, tests/test_composition_fuzz.py)."""
from __future__ import annotations

import os
import traceback

import torch

import composition_fuzz_model as fuzz
import composition_ranks
from composition_evidence import missing
from composition_models import batch, build, is_pipeline, micro_step_loss, named_params, plain_names

STEPS = composition_ranks.STEPS


def _global_index(model: torch.nn.Module, name: str) -> int:
    """The layer a parameter belongs to in the plain model (``layers.<index>``)."""
    if hasattr(model, "layer_range"):  # a pipeline stage: chunks.0.<local index>, tied_modules.<key>
        name = plain_names(model)[name]
    parts = name.split(".")
    if parts[0] == "module":  # a TensorParallelModule
        parts = parts[1:]
    return int(parts[1])


def _model(features: tuple[str, ...], cfg: dict, run: dict) -> torch.nn.Module:
    import zkit
    from zkit.zero.sharded_params import ZeroParameter

    if "zero_init" in features:
        with zkit.zero.Init(config_dict_or_path=cfg):
            model = build(features)
        run["init_partitioned"] = any(isinstance(p, ZeroParameter) for p in model.parameters())
    else:
        model = build(features)
    if "partial_freeze" in features:
        for name, p in model.named_parameters():
            if _global_index(model, name) < 2:
                p.requires_grad_(False)
    return model


def _groups(model: torch.nn.Module) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    weights = [p for p in params if p.dim() >= 2]
    others = [p for p in params if p.dim() < 2]
    return [{"params": weights}, {"params": others, "lr": 5e-3, "weight_decay": 0.0}]


def _engine(features: tuple[str, ...], cfg: dict, run: dict):
    model = _model(features, cfg, run)
    kwargs = {"model_parameters": _groups(model)} if "param_groups" in features else {}
    return composition_ranks._engine(features, cfg, run, model=model, **kwargs)


def _micro_batches(engine, features: tuple[str, ...], cfg: dict, step: int) -> list[tuple]:
    micro, accum = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    replicas = fuzz.matrix.replicas(features)
    replica = 0 if replicas == 1 else torch.distributed.get_rank() % replicas
    rows = 4 // replicas
    x, y = batch(step, features)
    x = x if x.dtype == torch.long else x.to(engine.dtype)
    mine_x, mine_y = x[rows * replica: rows * (replica + 1)], y[rows * replica: rows * (replica + 1)]
    out = [(mine_x[i:i + micro], mine_y[i:i + micro]) for i in range(0, rows, micro)]
    assert len(out) == accum, (len(out), accum)
    return out


def _train(engine, features, cfg, steps, run: dict, micro=slice(None)) -> None:
    for step in steps:
        batches = _micro_batches(engine, features, cfg, step)[micro]
        if is_pipeline(features):
            engine.train_batch(iter(batches))
        else:
            for xs, ys in batches:
                engine.backward(micro_step_loss(engine, features, xs, ys))
                engine.step()
        if micro.stop is None:  # a step ended (not the first half of a batch before a save)
            composition_ranks.between_steps(engine, features, run)


def _stages_missing(features: tuple[str, ...], mine: list[str], model: torch.nn.Module) -> list[str]:
    """In a pipeline, the traces missing on the stages that train something: a stage wholly
    frozen (partial_freeze) has no backward to recompute and no optimizer state to offload, so
    its traces are the other stage's."""
    if not is_pipeline(features):
        return mine
    trains = any(p.requires_grad for p in model.parameters())
    stages: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(stages, (trains, mine))
    return sorted({why for trains, theirs in stages if trains for why in theirs})


def _run(features: tuple[str, ...], nvme_path: str, ckpt_root: str, ds_root: str | None) -> dict:
    cfg = fuzz.config(features, nvme_path)
    run: dict = {}
    try:
        engine, model = _engine(features, cfg, run)
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return {"refused": f"{type(exc).__name__}: {exc}"}
    try:
        frozen_before = ({n: p for n, p in named_params(model).items() if int(n.split(".")[1]) < 2}
                         if "partial_freeze" in features else {})
        where = f"{ckpt_root}/{'-'.join(features)}"
        if {"save_load", "dcp_checkpoint", "reshard"} & set(features):
            _train(engine, features, cfg, range(STEPS - 1), run)
            load_cfg = fuzz.resharded(cfg, features) if "reshard" in features else cfg
            run["saved_stage"] = cfg["zero_optimization"]["stage"]
            try:  # refusing to save, or to load what was saved, is not silent either
                where = composition_ranks.save(engine, where, dcp="dcp_checkpoint" in features, run=run)
                engine.close()
                engine, model = _engine(features, load_cfg, run)
                engine.load_checkpoint(where)
            except Exception as exc:  # noqa: BLE001 - the refusal is the result
                return {"refused_checkpoint": f"{type(exc).__name__}: {exc}"}
            run["loaded_steps"] = engine.global_steps
            _train(engine, features, load_cfg, range(STEPS - 1, STEPS), run)
        elif "ds_import" in features:  # DeepSpeed took the first steps
            from composition_fuzz_peer import run_name

            try:  # refusing to load it is not silent either
                engine.load_checkpoint(f"{ds_root}/{run_name(*fuzz.deepspeed_run(features))}")
            except Exception as exc:  # noqa: BLE001 - the refusal is the result
                return {"refused_checkpoint": f"{type(exc).__name__}: {exc}"}
            run["loaded_steps"] = engine.global_steps
            # one micro-step in all is the one the engine's FLOP probe runs eagerly (zkit.core.compile)
            run["probed_only"] = cfg["gradient_accumulation_steps"] == 1
            _train(engine, features, cfg, range(STEPS - 1, STEPS), run)
        elif "save_mid_accum" in features:
            _train(engine, features, cfg, range(STEPS - 1), run)
            _train(engine, features, cfg, [STEPS - 1], run, micro=slice(0, 1))
            try:
                engine.save_checkpoint(where)
            except Exception as exc:  # noqa: BLE001 - refusing to save half a batch is not silent either
                return {"refused_checkpoint": f"{type(exc).__name__}: {exc}"}
            engine.close()
            engine, model = _engine(features, cfg, run)
            engine.load_checkpoint(where)
            run["loaded_micro_steps"] = engine.micro_steps
            _train(engine, features, cfg, [STEPS - 1], run, micro=slice(1, None))
        else:
            _train(engine, features, cfg, range(STEPS), run)
        params = named_params(model)
        run["frozen_unchanged"] = all(torch.equal(params[n], p) for n, p in frozen_before.items() if n in params)
        # a resharded run's engine is the loading one: its stage is the reshard's, checked there
        shown = tuple(f for f in features if not ("reshard" in features and f in fuzz.matrix.STAGES))
        return {"params": params, "missing": _stages_missing(features, missing(shown, engine, model, run), model)}
    except Exception:  # noqa: BLE001 - a crash after initialize is a failure
        return {"crashed": traceback.format_exc(limit=10)}
    finally:
        engine.close()


#: how long a rank that finished a set waits for the others: a rank left inside a collective (its
#: peer refused or raised alone) would otherwise hang every later set
HANG_S = 120


class SetHung(RuntimeError):
    """A rank finished a set and another did not within :data:`HANG_S`."""


def _meeting_store(rank: int, world: int):
    """A key-value store of this group's own, served by rank 0 (agreed on before any set runs)."""
    import torch.distributed as dist
    from datetime import timedelta

    from zkit.testing import free_port

    port = [free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    return dist.TCPStore("127.0.0.1", port[0], world, is_master=rank == 0, timeout=timedelta(seconds=HANG_S))


def run_sets(sets: list[tuple[str, ...]], nvme_path: str, ckpt_root: str, ds_root: str | None = None,
             partial_path: str | None = None) -> dict:
    """Every set of features in one process group, in order (``ds_root``: DeepSpeed's checkpoints
    of the ``ds_import`` sets). After each set the ranks meet in a TCP store, not in a
    collective: a set some rank does not finish is reported by the others (with what they had
    so far in ``partial_path``, after every set), and ranks that end a set differently make it a failure."""
    import pickle
    from datetime import timedelta

    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    store = _meeting_store(rank, world)
    out: dict = {}
    for i, s in enumerate(sets):
        got = _run(s, nvme_path, ckpt_root, ds_root)
        kind = next(iter(got))
        store.set(f"fuzz/{i}/{rank}", kind)
        try:
            store.wait([f"fuzz/{i}/{r}" for r in range(world)], timedelta(seconds=HANG_S))
        except Exception:  # noqa: BLE001 - the store's timeout error has no public type
            raise SetHung(f"{','.join(s)}: rank {rank} ended it ({kind}: {str(got[kind])[:300]}), and another "
                          f"rank did not within {HANG_S} s") from None
        kinds = {r: store.get(f"fuzz/{i}/{r}").decode() for r in range(world)}
        if len(set(kinds.values())) > 1:
            got = {"crashed": f"the ranks ended it differently {kinds}; rank {rank}: {str(got.get(kind))[:600]}"}
        out[s] = got
        if partial_path is not None:  # what this rank finished, should the group die in a later set
            # (written aside, then renamed: a rank killed mid-write leaves the previous file whole)
            with open(partial_path.format(rank=rank) + ".tmp", "wb") as f:
                pickle.dump(out, f)
            os.replace(partial_path.format(rank=rank) + ".tmp", partial_path.format(rank=rank))
    # rank 0 serves the store: it leaves last
    store.set(f"fuzz/end/{rank}", "1")
    if rank == 0:
        store.wait([f"fuzz/end/{r}" for r in range(world)], timedelta(seconds=HANG_S))
    return out
