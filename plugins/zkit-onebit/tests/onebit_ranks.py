"""Functions run on every rank of a gloo group by the multi-rank tests (importable by name,
since ranks are spawned)."""
from __future__ import annotations

import io

import torch
import torch.distributed as dist

from zkit.torch_distributed.communicator import TorchCommunicator
from zkit_onebit.adam import OneBitAdam
from zkit_onebit.communicator import OneBitCommunicator


def scenarios(jobs: list[tuple]) -> dict:
    """Run several of the functions below in one group (starting ranks is the slow part).
    ``jobs``: ``(function name, args)`` or ``(label, function name, args)``."""
    out = {}
    for job in jobs:
        label, name, args = job if len(job) == 3 else (job[0], *job)
        out[label] = globals()[name](*args)
    return out


def rank_inputs(rank: int, steps: int, numel: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return [torch.randn(numel, generator=g) for _ in range(steps)]


def compressed_all_reduce_steps(numel: int, steps: int, dtype: str = "float32") -> dict:
    """Run ``steps`` compressed all-reduces of per-rank inputs; return results, errors, stats."""
    rank = dist.get_rank()
    comm = OneBitCommunicator(TorchCommunicator(), min_numel=1)
    outs = []
    for x in rank_inputs(rank, steps, numel):
        t = x.to(getattr(torch, dtype))
        comm.all_reduce(t, op="avg", key="t")
        outs.append(t.float())
    fb = comm._feedback["t"]
    return {
        "outs": outs,
        "worker": fb.worker.clone(),
        "server": fb.server.clone(),
        "stats": comm.stats(),
        "transport": comm.transport.stats(),
    }


def dead_elements(numel: int) -> torch.Tensor:
    """A live mask with isolated and consecutive dead elements (a whole chunk's worth at the end)."""
    live = torch.ones(numel, dtype=torch.bool)
    live[::5] = False
    live[-(numel // 3):] = False
    return live


def masked_all_reduce_steps(numel: int, steps: int) -> dict:
    """Compressed all-reduces whose dead elements are masked out."""
    from zkit_onebit.collectives import compressed_all_reduce
    from zkit_onebit.compression import ChunkLayout, ErrorFeedback, LiveMask

    rank, w = dist.get_rank(), dist.get_world_size()
    layout = ChunkLayout.for_all_reduce(numel, w)
    fb = ErrorFeedback.zeros(layout, torch.device("cpu"), with_server=True)
    mask = LiveMask.from_flat(layout, dead_elements(numel))
    outs = []
    for x in rank_inputs(rank, steps, numel, seed=2):
        compressed_all_reduce(TorchCommunicator(), x, fb, mask=mask)
        outs.append(x)
    return {"outs": outs, "worker": fb.worker.clone(), "server": fb.server.clone()}


SYNTHETIC_SHAPES = [(37,), (5, 7)]
#: Elements of the first parameter that get no gradient before the freeze (``v = 0`` there).
COLD = 5


def synthetic_grads(rank: int, step: int, freeze_step: int) -> list[torch.Tensor]:
    """Per-rank gradients that do not depend on the parameters, so a reference can replay them."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    grads = [torch.randn(shape, generator=g) * (1 + i) for i, shape in enumerate(SYNTHETIC_SHAPES)]
    if step < freeze_step:
        grads[0][:COLD] = 0
    return grads


def synthetic_params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in SYNTHETIC_SHAPES]


def run_synthetic(opt, params: list, comm, steps: int, cold_steps: int) -> dict:
    """Step ``opt`` on :func:`synthetic_grads` (averaged first while the optimizer asks for it);
    the flat parameters before and after each step, and whether each step reduced gradients."""
    x0 = torch.cat([p.detach().reshape(-1).clone() for p in params])
    out, reduced = [], []
    for step in range(steps):
        reduced.append(opt.needs_gradient_reduction)
        for p, grad in zip(params, synthetic_grads(dist.get_rank(), step, cold_steps)):
            p.grad = grad
            if opt.needs_gradient_reduction:
                comm.all_reduce(p.grad, op="avg")
        opt.step()
        out.append(torch.cat([p.detach().reshape(-1).clone() for p in params]))
    return {"params": out, "x0": x0, "reduced": reduced}


def onebit_adam_synthetic(freeze_step: int, steps: int, weight_decay: float) -> dict:
    """1-bit Adam (stage-0 momentum exchange) on synthetic gradients; parameters after each step."""
    comm = TorchCommunicator()
    params = synthetic_params()
    opt = OneBitAdam(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay,
                     freeze_step=freeze_step, comm=comm)
    out = run_synthetic(opt, params, comm, steps, freeze_step)
    return {"params": out["params"], "x0": out["x0"]}


ZERO_ONE = dict(var_freeze_step=10, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4)
#: Steps during which the cold elements get no gradient under 0/1 Adam (they come alive at the
#: next variance step).
ZERO_ONE_COLD_STEPS = 5


def zero_one_adam_synthetic(steps: int, weight_decay: float) -> dict:
    """0/1 Adam on synthetic gradients; parameters after each step, and the phase flags."""
    from zkit_onebit.zeroone_adam import ZeroOneAdam

    comm = TorchCommunicator()
    params = synthetic_params()
    opt = ZeroOneAdam(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay, comm=comm,
                      **ZERO_ONE)
    return {**run_synthetic(opt, params, comm, steps, ZERO_ONE_COLD_STEPS), "stats": comm.stats()}


def compressed_all_reduce_steps_bf16(numel: int, steps: int) -> dict:
    return compressed_all_reduce_steps(numel, steps, "bfloat16")


def compressed_reduce_scatter_steps(numel: int, steps: int) -> dict:
    rank, w = dist.get_rank(), dist.get_world_size()
    comm = OneBitCommunicator(TorchCommunicator(), min_numel=1)
    outs = []
    for x in rank_inputs(rank, steps, numel, seed=1):
        out = torch.empty(numel // w)
        comm.reduce_scatter(out, x, op="avg", key="x")
        outs.append(out)
    return {"outs": outs, "stats": comm.stats()}


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def _train(model, opt, comm, steps: int, start: int = 0) -> list[float]:
    """The data-parallel loop an engine runs: backward, average gradients while the optimizer
    asks for it, step."""
    losses = []
    for step in range(start, start + steps):
        x, y = _batch(dist.get_rank(), step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if getattr(opt, "needs_gradient_reduction", True):
            for p in model.parameters():
                comm.all_reduce(p.grad, op="avg")
        opt.step()
        losses.append(loss.item())
    return losses


def onebit_adam_run(freeze_step: int, steps: int, weight_decay: float = 0.0) -> dict:
    """Train with 1-bit Adam and, on the same data, with AdamW (averaged gradients)."""
    comm = TorchCommunicator()
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=freeze_step, weight_decay=weight_decay, comm=comm)
    params_per_step = []
    for step in range(steps):
        _train(model, opt, comm, 1, start=step)
        params_per_step.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=weight_decay, foreach=False)
    ref_params = []
    for step in range(freeze_step):
        _train(ref, ref_opt, comm, 1, start=step)
        ref_params.append(torch.cat([p.detach().reshape(-1).clone() for p in ref.parameters()]))
    return {"params": params_per_step, "adamw": ref_params, "stats": comm.stats()}


def checkpoint_resume(freeze_step: int, before: int, after: int) -> dict:
    """Train ``before`` steps, save, train ``after`` more; then load the save into a fresh model and
    optimizer and train the same ``after`` steps. Both must end identically."""
    comm = TorchCommunicator()
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=freeze_step, comm=comm)
    _train(model, opt, comm, before)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train(model, opt, comm, after, start=before)
    straight = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model2 = _model(seed=123)
    opt2 = OneBitAdam(model2.parameters(), lr=1e-2, freeze_step=freeze_step, comm=comm)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    _train(model2, opt2, comm, after, start=before)
    resumed = torch.cat([p.detach().reshape(-1) for p in model2.parameters()])
    return {"straight": straight, "resumed": resumed, "frozen": opt2.frozen}


class FakeShardedPartitioner:
    """What the ZeRO-1 partitioner does each step, reduced to its communication: reduce-scatter the
    flat gradient, step the optimizer on the shard, all-gather the parameters."""

    stage = 1

    def __init__(self, comm, numel: int) -> None:
        self.comm = comm
        w = comm.world_size
        self.shard = -(-numel // w)
        self.flat = torch.zeros(self.shard * w)
        self.master = torch.zeros(self.shard, requires_grad=True)


def zero1_run(freeze_step: int, steps: int) -> dict:
    """1-bit Adam over a stage-1 partitioner stand-in: its gradient reduce-scatter turns 1-bit."""
    rank, w = dist.get_rank(), dist.get_world_size()
    model = _model()
    flat_params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # the toy model is smaller than the default compression threshold
    part = FakeShardedPartitioner(OneBitCommunicator(TorchCommunicator(), min_numel=1), flat_params.numel())
    part.flat[: flat_params.numel()] = flat_params
    with torch.no_grad():
        part.master.copy_(part.flat.view(w, -1)[rank])
    opt = OneBitAdam([part.master], lr=1e-2, freeze_step=freeze_step)
    opt.attach(part)
    wrapped = isinstance(part.comm, OneBitCommunicator)
    compress_flags = []
    for step in range(steps):
        x, y = _batch(rank, step)
        for p in model.parameters():
            p.grad = None
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads = torch.zeros_like(part.flat)
        grads[: flat_params.numel()] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        part.master.grad = torch.empty(part.shard)
        part.comm.reduce_scatter(part.master.grad, grads, op="avg")
        opt.step()
        compress_flags.append(part.comm.compress)
        part.comm.all_gather(part.flat, part.master.detach())
        offset = 0
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(part.flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
    return {"wrapped": wrapped, "flags": compress_flags, "flat": part.flat.clone(), "stats": part.comm.stats()}


def _engine(stage: int, precision: str, freeze_step: int, optimizer: str = "OneBitAdam"):
    import zkit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 64))
    params = {"lr": 1e-3, "freeze_step": freeze_step}
    if optimizer == "ZeroOneAdam":
        params = {"lr": 1e-3, "var_freeze_step": freeze_step, "var_update_scaler": 1, "local_step_scaler": 2}
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": optimizer, "params": params},
        "zero_optimization": {"stage": stage},
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    engine, opt, _, _ = zkit.initialize(model=model, config=config)
    return engine, opt


def _engine_steps(engine, start: int, steps: int) -> tuple[list[float], list]:
    dtype = next(engine.module.parameters()).dtype
    losses, reduction = [], []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(10_000 * step + dist.get_rank())
        x = torch.randn(4, 64, generator=g).to(dtype)
        loss = (engine(x).float() - x.float().roll(1, dims=1)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        reduction.append(getattr(engine.partitioner, "gradient_reduction", None))
    return losses, reduction


def _flat_params(engine) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])


def engine_run(stage: int, precision: str, freeze_step: int, steps: int, optimizer: str = "OneBitAdam") -> dict:
    """Train through ``zkit.initialize`` with ``"optimizer": {"type": optimizer}``."""
    engine, opt = _engine(stage, precision, freeze_step, optimizer)
    losses, reduction = _engine_steps(engine, 0, steps)
    out = {
        "losses": losses,
        "params": _flat_params(engine),
        "frozen": opt.frozen,
        "exchange": opt.exchange,
        "reduction": reduction,
        "stats": engine.comm_stats(),
    }
    engine.close()
    return out


def engine_checkpoint_resume(
    stage: int, freeze_step: int, before: int, after: int, save_dir: str, optimizer: str = "OneBitAdam"
) -> dict:
    """Save mid-compression through the engine, go on; load into a new engine, go on the same."""
    engine, _ = _engine(stage, "fp32", freeze_step, optimizer)
    _engine_steps(engine, 0, before)
    engine.save_checkpoint(save_dir, tag="mid")
    _engine_steps(engine, before, after)
    straight = _flat_params(engine)
    engine.close()
    engine, opt = _engine(stage, "fp32", freeze_step, optimizer)
    engine.load_checkpoint(save_dir, tag="mid")
    frozen_after_load = opt.frozen
    _, reduction = _engine_steps(engine, before, after)
    resumed = _flat_params(engine)
    engine.close()
    return {"straight": straight, "resumed": resumed, "frozen": frozen_after_load, "reduction": reduction}


def engine_onebit_communicator(steps: int) -> dict:
    """Adam over ``zkit.Stack(communicator="onebit")``: gradients all-reduced 1-bit."""
    import zkit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 64))
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    engine, *_ = zkit.initialize(model=model, config=config, stack=zkit.Stack(communicator="onebit"))
    losses, _ = _engine_steps(engine, 0, steps)
    out = {"losses": losses, "params": _flat_params(engine), "stats": engine.comm_stats(),
           "keys": sorted(engine.comm._feedback), "type": type(engine.comm).__name__}
    engine.close()
    return out


def onebit_checkpoint_into_adamw(save_dir: str) -> dict:
    """A OneBitAdam checkpoint past its freeze step, loaded into an AdamW engine: with its
    optimizer state (refused), and weights only (accepted, the weights equal)."""
    import zkit
    from zkit.core.checkpoint_errors import CheckpointError

    engine, _ = _engine(1, "fp32", 2, "OneBitAdam")
    _engine_steps(engine, 0, 4)
    engine.save_checkpoint(save_dir, tag="onebit")
    saved = _flat_params(engine)
    engine.close()
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 64))
    adamw, *_ = zkit.initialize(model=model, config={"train_micro_batch_size_per_gpu": 4,
                                                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                                     "zero_optimization": {"stage": 1}})
    out: dict = {}
    try:
        adamw.load_checkpoint(save_dir, tag="onebit")
        out["with_state"] = "loaded"
    except CheckpointError as exc:
        out["with_state"] = str(exc)
    adamw.load_checkpoint(save_dir, tag="onebit", load_optimizer_states=False)
    out["weights_equal"] = bool(torch.equal(_flat_params(adamw), saved))
    adamw.close()
    return out
