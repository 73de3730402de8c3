"""Rank functions for the offloaded-training tests (module level: ranks are spawned processes).

The model and batches follow ``tests/engine_ranks.py``: a tiny tied-embedding net with uneven
parameter sizes, and a global batch that every rank slices like a DistributedSampler would, so
``micro`` x ``world`` samples make the same global batch for any world size.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F

import zkit

DTYPES = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}}}
VOCAB = 13
#: final-parameter tolerance of an offloaded run against the same run without offload. Low-precision
#: runs round the same fp32 master to 16 bits; the CPU kernel and torch's AdamW differ in the last
#: fp32 bits, which a 16-bit rounding can turn into one 16-bit ulp.
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-3}


def max_diff(a, b) -> float:
    """Largest elementwise difference between two lists of tensors."""
    return max((x - y).abs().max().item() for x, y in zip(a, b))


class TiedNet(torch.nn.Module):
    """Embedding tied to the output head, a parameter used twice, uneven sizes."""

    def __init__(self, vocab: int = VOCAB, dim: int = 6) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = torch.tanh(self.mix(h))
        h = self.norm(torch.tanh(self.mix(h)) + h)
        logits = h @ self.embed.weight.t()
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))


def make_model(seed: int = 0) -> TiedNet:
    torch.manual_seed(seed)
    return TiedNet()


#: ``offload_param`` for the parameter-offload tests: on NVMe, the smallest shard (the LayerNorm's,
#: 6 elements on 2 ranks) stays in host memory (``max_in_cpu``), and two buffers hold the others.
PARAM_NVME = {"buffer_count": 2, "buffer_size": 100, "max_in_cpu": 6}


def config(stage: int, dtype: str, world: int, offload: str = "none", nvme_path: str | None = None,
           micro: int = 2, param: str = "none", **extra) -> dict:
    """Small buckets and sub-groups so that every rank owns several pieces in several sub-groups.
    ``offload``/``param``: the offload_optimizer / offload_param device."""
    zero: dict = {"stage": stage, "reduce_bucket_size": 40, "overlap_comm": True, "sub_group_size": 50}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=100)
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, "nvme_path": nvme_path, "buffer_count": 2}
    if param != "none":
        zero["offload_param"] = {"device": param, "nvme_path": nvme_path, "pin_memory": False,
                                 **(PARAM_NVME if param == "nvme" else {})}
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 1000,
        **DTYPES[dtype],
    }
    cfg.update(extra)
    return cfg


def global_batches(steps: int, per_step: int, seq: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(0, VOCAB, (steps * per_step, seq), generator=g)
    labels = torch.randint(0, VOCAB, (steps * per_step, seq), generator=g)
    return ids, labels


def train(engine, steps: int, micro: int, start: int = 0, between=None) -> list[float]:
    """``steps`` optimizer steps; rank r takes rows [r*micro, (r+1)*micro) of each global batch.
    ``between()`` runs after every step (to look at swap files mid-training)."""
    world, rank = engine.world_size, engine.rank
    ids, labels = global_batches(start + steps, micro * world)
    losses = []
    for step in range(start, start + steps):
        first = (step * world + rank) * micro
        loss = engine(ids[first : first + micro], labels[first : first + micro])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if between is not None:
            between()
    return losses


def params_of(engine) -> list[torch.Tensor]:
    from zkit.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):  # stage 3: gather first
        return [p.detach().float().clone() for p in engine.module.parameters()]


def swap_files(engine, swapper=None) -> list[str]:
    swapper = swapper or engine.allocator.swapper
    return sorted(p.name for p in swapper.dir.glob("*.swp")) if swapper.dir.exists() else []


def training_matrix(cases: list[tuple[int, str, str]], nvme_root: str, steps: int = 3) -> dict:
    """Train every (stage, dtype, offload device); return final parameters and losses, and for
    NVMe the swap files seen after each step and whether the run directory is gone after close."""
    world = torch.distributed.get_world_size()
    out = {}
    for stage, dtype, device in cases:
        cfg = config(stage, dtype, world, device, nvme_root if device == "nvme" else None)
        engine, *_ = zkit.initialize(model=make_model(), config=cfg)
        seen: list[list[str]] = []
        between = (lambda: seen.append(swap_files(engine))) if device == "nvme" else None
        losses = train(engine, steps, 2, between=between)
        result = {"params": params_of(engine), "losses": losses, "allocator": engine.records["allocator"].name,
                  "optimizer": type(engine.optimizer).__name__}
        if device == "nvme":
            state = engine.optimizer.state
            result.update(swap_files=seen, state_type=type(state).__name__,
                          resident_tensors=sum(t.numel() for st in state.values() for t in st.values()
                                               if torch.is_tensor(t) and t.dim() > 0),
                          swap_dir=str(engine.allocator.swapper.dir),
                          master_is_placeholder=all(m.stride() == (0,) for m in engine.partitioner.master),
                          grad_shards=len(getattr(engine.partitioner, "grad_shards", ())))
        engine.close()
        if device == "nvme":
            result["swap_dir_after_close"] = Path(result["swap_dir"]).exists()
        out[(stage, dtype, device)] = result
    return out


def checkpoint_then_continue(root: str, cases: list[tuple[int, str]], nvme_root: str) -> dict:
    """Per (stage, offload device): train 2 steps, save under ``root``, train 2 more: the
    uninterrupted run a resumed one must match."""
    world = torch.distributed.get_world_size()
    out = {}
    for case in cases:
        stage, device, param = (*case, "none")[:3]
        cfg = config(stage, "fp32", world, device, nvme_root, param=param)
        engine, *_ = zkit.initialize(model=make_model(), config=cfg)
        train(engine, 2, 2)
        engine.save_checkpoint(f"{root}/{'-'.join(map(str, case))}")
        losses = train(engine, 2, 2, start=2)
        out[case] = {"losses": losses, "params": params_of(engine)}
        engine.close()
    return out


def resume(root: str, cases: list[tuple[int, str]], nvme_root: str) -> dict:
    """Load each case's checkpoint on any world size (2 ranks x micro 2 or 1 rank x micro 4 make
    the same global batch) and train the 2 steps after it."""
    world = torch.distributed.get_world_size()
    micro = 4 // world
    out = {}
    for case in cases:
        stage, device, param = (*case, "none")[:3]
        torch.manual_seed(999)  # a different init: everything must come from the checkpoint
        cfg = config(stage, "fp32", world, device, nvme_root, micro=micro, param=param)
        engine, *_ = zkit.initialize(model=TiedNet(), config=cfg)
        engine.load_checkpoint(f"{root}/{'-'.join(map(str, case))}")
        steps = engine.global_steps
        losses = train(engine, 2, micro, start=2)
        out[case] = {"losses": losses, "params": params_of(engine), "steps": steps}
        engine.close()
    return out


def param_offload_matrix(cases: list[tuple[str, str, str]], nvme_root: str, steps: int = 3) -> dict:
    """Stage 3 per (dtype, offload_optimizer device, offload_param device): final parameters and
    losses; with NVMe, the parameter swap files, the memory report and whether the run
    directories are gone after close."""
    world = torch.distributed.get_world_size()
    out = {}
    for dtype, opt, param in cases:
        cfg = config(3, dtype, world, opt, nvme_root if "nvme" in (opt, param) else None, param=param)
        engine, *_ = zkit.initialize(model=make_model(), config=cfg)
        losses = train(engine, steps, 2)
        result = {"params": params_of(engine), "losses": losses, "allocator": engine.records["allocator"].name,
                  "optimizer": type(engine.optimizer).__name__, "memory": engine.memory(),
                  "shard_devices": sorted({su.shard.device.type for su in engine.partitioner.sharded
                                           if su.shard is not None})}
        alloc = engine.allocator
        dirs = [s.dir for s in (getattr(alloc, "swapper", None), getattr(alloc, "param_swapper", None)) if s]
        if param == "nvme":
            result["param_files"] = swap_files(engine, alloc.param_swapper)
            result["stored_units"] = [su.module_name for su in engine.partitioner.sharded if su.shard is None]
        engine.close()
        result["dirs_after_close"] = [d.exists() for d in dirs]
        out[(dtype, opt, param)] = result
    return out


def param_offload_errors(nvme_root: str, zeros: list[dict]) -> list[str]:
    return [param_offload_error(nvme_root, zero) for zero in zeros]


def param_offload_error(nvme_root: str, zero: dict) -> str:
    """The error of building an engine with ``zero`` merged into the stage-3 test config."""
    cfg = config(3, "fp32", torch.distributed.get_world_size(), "none", nvme_root, param="nvme")
    for key, value in zero.items():
        if isinstance(value, dict):
            cfg["zero_optimization"].setdefault(key, {}).update(value)
        else:
            cfg["zero_optimization"][key] = value
    try:
        engine, *_ = zkit.initialize(model=make_model(), config=cfg)
    except ValueError as exc:
        return str(exc)
    engine.close()
    return ""


def built_into_nvme(nvme_root: str, steps: int = 3) -> dict:
    """A model built under ``zkit.zero.Init`` with an NVMe ``offload_param`` config (every shard
    to NVMe as its module is built) trains like the same model built whole without offload."""
    from zkit.zero import Init

    world = torch.distributed.get_world_size()
    base_engine, *_ = zkit.initialize(model=make_model(), config=config(3, "fp32", world))
    base = train(base_engine, steps, 2)
    base_params = params_of(base_engine)
    base_engine.close()
    cfg = config(3, "fp32", world, "nvme", nvme_root, param="nvme")
    with Init(config=cfg):
        model = make_model()
    units = {id(p._zkit_unit): p._zkit_unit for p in model.parameters()}.values()
    in_memory_at_build = sorted(su.unit.shard for su in units if su.shard is not None)
    built_by = sorted({type(su.allocator).__name__ for su in units})
    engine, *_ = zkit.initialize(model=model, config=cfg)
    losses = train(engine, steps, 2)
    out = {"base": base, "losses": losses, "diff": max_diff(params_of(engine), base_params),
           "in_memory_at_build": in_memory_at_build, "built_by": built_by,
           "stored": sorted(su.module_name for su in engine.partitioner.sharded if su.shard is None)}
    engine.close()
    return out


def ds_tensor_of_stored_shards(nvme_root: str) -> dict:
    """DeepSpeed's ``param.ds_tensor`` of parameters whose shards are on NVMe, after a step: the
    values (against the gathered parameter) and whether the store still holds a buffer for it."""
    from zkit.zero import GatheredParameters

    world = torch.distributed.get_world_size()
    engine, *_ = zkit.initialize(model=make_model(), config=config(3, "fp32", world, "none", nvme_root, param="nvme"))
    train(engine, 1, 2)
    stored = [p for p in engine.module.parameters() if p._zkit_unit.shard is None]
    pieces = [p.ds_tensor for p in stored]
    with GatheredParameters(stored):
        full = [p.detach().reshape(-1).clone() for p in stored]
    store = engine.partitioner.param_store
    out = {"stored": len(stored), "match": all(torch.equal(a, b) for a, b in zip(pieces, full)),
           "buffers_held": [b.users for b in store.buffers]}
    engine.close()
    return out


def nvme_memory_vs_estimate(nvme_root: str) -> dict:
    """``engine.memory()`` of NVMe-offloaded stages 2 and 3 after a step, next to the estimator's
    figures for the same model and config."""
    from zkit.estimator.command import store_align_elems
    from zkit.estimator import model_state_bytes

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    out = {}
    for stage in (2, 3):
        cfg = config(stage, "fp32", world, "nvme", nvme_root)
        model = make_model()
        shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        engine, *_ = zkit.initialize(model=model, config=cfg)
        train(engine, 1, 2)
        zero = cfg["zero_optimization"]
        est = model_state_bytes(shapes, stage=stage, world_size=world, dtype="fp32", offload="nvme", rank=rank,
                                reduce_bucket_size=zero["reduce_bucket_size"], overlap_comm=zero["overlap_comm"],
                                accelerator=False, stage3_param_persistence_threshold=0,
                                sub_group_size=zero["sub_group_size"], buffer_count=2,
                                align_elems=store_align_elems("nvme"))
        out[stage] = {"memory": engine.memory(), "device": est.device, "nvme": est.nvme}
        engine.close()
    return out


def checkpoint_round_trips(tmp_path_factory, cases: list, prefix: str) -> tuple:
    """Uninterrupted runs of ``cases`` on 2 ranks, resumed on 2 ranks, resumed (resharded) on 1
    rank; with the NVMe root, for :func:`check_resumes_and_reshards`."""
    from zkit.testing import run_ranks

    nvme, ckpt = tmp_path_factory.mktemp(f"{prefix}_nvme"), str(tmp_path_factory.mktemp(prefix))
    args = (ckpt, cases, str(nvme))
    full = run_ranks(checkpoint_then_continue, 2, args=args, timeout=180)
    same = run_ranks(resume, 2, args=args, timeout=180)
    (one,) = run_ranks(resume, 1, args=args, timeout=180)
    return full, same, one, nvme


def check_resumes_and_reshards(runs: tuple, case) -> None:
    """A resumed run continues exactly (2 ranks) or within fp32 resharding noise (1 rank), and
    every swap directory is gone."""
    import pytest

    full, same, one, nvme = runs
    for a, b in zip(full, same):
        assert b[case]["steps"] == 2
        assert max_diff(a[case]["params"], b[case]["params"]) < 1e-6
        assert b[case]["losses"] == pytest.approx(a[case]["losses"], rel=1e-6)
    assert one[case]["steps"] == 2
    assert max_diff(one[case]["params"], full[0][case]["params"]) < 1e-5
    assert list(nvme.iterdir()) == []


#: optimizer sections whose meaning must not change with offload_optimizer (DeepSpeed's defaults:
#: "Adam" is AdamW unless adam_w_mode is false; weight_decay defaults to 0)
SAME_OPTIMIZER_CASES = {
    "Adam": {"type": "Adam", "params": {"lr": 0.02, "weight_decay": 0.1}},
    "Adam-l2": {"type": "Adam", "params": {"lr": 0.02, "weight_decay": 0.1, "adam_w_mode": False}},
    "AdamW": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.1}},
    "AdamW-default-decay": {"type": "AdamW", "params": {"lr": 0.02}},
    "adamw-lower-case": {"type": "adamw", "params": {"lr": 0.02, "betas": [0.8, 0.99], "eps": 1e-6}},
}
#: optimizer types that name the CPU Adam itself: the same result as DeepSpeed's default (AdamW)
CPU_ADAM_CASES = {
    "DeepSpeedCPUAdam": {"type": "DeepSpeedCPUAdam", "params": {"lr": 0.02, "weight_decay": 0.1}},
    "cpu_adam-adamw_mode-false": {"type": "cpu_adam", "params": {"lr": 0.02, "weight_decay": 0.1,
                                                                 "adamw_mode": False}},
}


def same_optimizer_with_and_without_offload(stage: int) -> dict:
    """Final parameters of each optimizer section, trained without and with offload_optimizer."""
    world = torch.distributed.get_world_size()
    out = {}
    for name, section in {**SAME_OPTIMIZER_CASES, **CPU_ADAM_CASES}.items():
        for device in ("none", "cpu"):
            cfg = config(stage, "fp32", world, device, optimizer=section)
            engine, *_ = zkit.initialize(model=make_model(), config=cfg)
            train(engine, 3, 2)
            out[(name, device)] = params_of(engine)
            engine.close()
    return out


def other_optimizer_on_offload(stage: int, nvme_root: str) -> dict:
    """SGD (no CPU kernel) with offload_optimizer: by config and by Stack on cpu (trained, next to
    the run without offload), and the error each route gives on nvme at initialize."""
    world = torch.distributed.get_world_size()
    sgd = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
    out: dict = {}
    for route, device in [("none", "none"), ("config", "cpu"), ("stack", "cpu")]:
        cfg = config(stage, "fp32", world, device, optimizer=sgd)  # a Stack's choice reads the section too
        stack = zkit.Stack(optimizer="sgd") if route == "stack" else None
        engine, *_ = zkit.initialize(model=make_model(), config=cfg, stack=stack)
        train(engine, 3, 2)
        out[route] = {"params": params_of(engine), "allocator": engine.records["allocator"].name}
        engine.close()
    for route in ("config", "stack"):
        cfg = config(stage, "fp32", world, "nvme", nvme_root, optimizer=sgd if route == "config" else None)
        try:
            zkit.initialize(model=make_model(), config=cfg, stack=zkit.Stack(optimizer="sgd") if route == "stack" else None)
            out[f"nvme-{route}"] = "accepted"
        except ValueError as exc:
            out[f"nvme-{route}"] = str(exc)
    return out


def deferred_copy_runs(cases: list[tuple], nvme_root: str, steps: int = 2) -> dict:
    """Per (stage, dtype, offload_optimizer device, offload_param device[, optimizer type]): the
    final parameters and losses of a plain run and of the same run with every host<->device copy
    deferred to a fake side stream until its event is waited (:mod:`zkit.fake_streams`), and what
    the queues saw. An optimizer that does not fuse (SGD) makes the partitioner copy the updated
    master into the parameters itself instead of the fused step writing them."""
    from zkit.fake_streams import installed

    world = torch.distributed.get_world_size()
    out = {}
    for case in cases:
        stage, dtype, opt, param, *optimizer = case
        extra = {"optimizer": {"type": optimizer[0], "params": {"lr": 0.05, "momentum": 0.9}}} if optimizer else {}
        runs = {}
        for deferred in (False, True):
            cfg = config(stage, dtype, world, opt, nvme_root if "nvme" in (opt, param) else None, param=param,
                         **extra)
            with installed() if deferred else contextlib.nullcontext([]) as made:
                engine, *_ = zkit.initialize(model=make_model(), config=cfg)
                ahead: list[int] = []  # side-stream copies not yet run as each module computes
                hooks = [m.register_forward_hook(lambda *_: ahead.append(sum(s.outstanding for s in made)))
                         for m in engine.module.modules()]
                losses = train(engine, steps, 2)
                for h in hooks:
                    h.remove()
                bound = engine.allocator.copies.max_in_flight
                params = params_of(engine)
                engine.close()
            runs[deferred] = {"params": params, "losses": losses,
                              "copies": sum(s.issued for s in made), "most_ahead": max(ahead, default=0),
                              "most_outstanding_ok": all(s.outstanding <= bound for s in made)}
        out[case] = runs
    return out


def grads_beside_master_matrix(cases: list[tuple[int, str, int]], steps: int = 3) -> dict:
    """CPU offload per (stage, dtype, gradient accumulation steps), run twice: as this machine
    places it (master and device are both the CPU, so the gradient shards are ``"grad"``
    buffers), and with the allocator answering ``grads_beside_master()`` as it does when a GPU
    is the device (the reduced chunks copied out of the buckets into fp32 ``"master_grad"``
    shards). Final parameters, losses and the allocator's peak bytes per purpose."""
    from zkit_offload.allocators import HostAllocator

    world = torch.distributed.get_world_size()
    out = {}
    for stage, dtype, gas in cases:
        for beside in (False, True):
            HostAllocator.grads_beside_master = (lambda self: True) if beside else (lambda self: False)
            try:
                cfg = config(stage, dtype, world, "cpu", gradient_accumulation_steps=gas)
                engine, *_ = zkit.initialize(model=make_model(), config=cfg)
                losses = train(engine, steps * gas, 2)
                out[(stage, dtype, gas, beside)] = {
                    "params": params_of(engine), "losses": losses,
                    "beside": engine.partitioner.grads_beside_master,
                    "peak": {k: v["peak"] for k, v in engine.allocator.stats().items()}}
                engine.close()
            finally:
                del HostAllocator.grads_beside_master
    return out


def built_with_host_params(steps: int = 3) -> dict:
    """A model built under ``zkit.zero.Init`` with ``offload_param: cpu``: the allocator that
    placed its shards, and training against the same model built whole without offload."""
    from zkit.zero import Init

    world = torch.distributed.get_world_size()
    base_engine, *_ = zkit.initialize(model=make_model(), config=config(3, "fp32", world))
    base = train(base_engine, steps, 2)
    base_params = params_of(base_engine)
    base_engine.close()
    cfg = config(3, "fp32", world, "cpu", param="cpu")
    with Init(config=cfg):
        model = make_model()
    units = {id(p._zkit_unit): p._zkit_unit for p in model.parameters()}.values()
    built_by = sorted({type(su.allocator).__name__ for su in units})
    engine, *_ = zkit.initialize(model=model, config=cfg)
    losses = train(engine, steps, 2)
    out = {"base": base, "losses": losses, "diff": max_diff(params_of(engine), base_params), "built_by": built_by}
    engine.close()
    return out
