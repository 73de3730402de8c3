"""Rank functions for the multi-rank engine tests (module level: ranks are spawned processes)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import zkit

DTYPES = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}}}


class TiedNet(torch.nn.Module):
    """Embedding tied to the output head, a parameter used twice, uneven sizes."""

    def __init__(self, vocab: int = 13, dim: int = 6) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = torch.tanh(self.mix(h))
        h = self.norm(torch.tanh(self.mix(h)) + h)  # self.mix used twice
        logits = h @ self.embed.weight.t()  # tied head
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))


def make_model(seed: int = 0) -> TiedNet:
    torch.manual_seed(seed)
    return TiedNet()


def global_batches(steps: int, gas: int, world: int, micro: int = 2, seq: int = 5):
    g = torch.Generator().manual_seed(123)
    n = steps * gas * world * micro
    ids = torch.randint(0, 13, (n, seq), generator=g)
    labels = torch.randint(0, 13, (n, seq), generator=g)
    return ids, labels


def config(stage: int, dtype: str, gas: int, world: int, micro: int = 2, **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, "overlap_comm": True},
        "steps_per_print": 1000,
        **DTYPES[dtype],
    }
    cfg.update(extra)
    return cfg


def train_engine(engine, steps: int, gas: int, world: int, micro: int = 2, start: int = 0) -> list[float]:
    """Each rank takes its slice of every global batch, like a DistributedSampler would."""
    ids, labels = global_batches(start + steps, gas, world, micro)
    rank = engine.rank
    losses = []
    for step in range(start, start + steps):
        total = 0.0
        for m in range(gas):
            first = ((step * gas + m) * world + rank) * micro
            loss = engine(ids[first : first + micro], labels[first : first + micro])
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / gas)
    return losses


def reference(steps: int, gas: int, world: int, micro: int = 2, clip: float = 0.0) -> list[torch.Tensor]:
    """Single-process torch on the same global batches."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    ids, labels = global_batches(steps, gas, world, micro)
    per_step = gas * world * micro
    for step in range(steps):
        opt.zero_grad()
        sl = slice(step * per_step, (step + 1) * per_step)
        model(ids[sl], labels[sl]).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def params_of(engine) -> list[torch.Tensor]:
    from zkit.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):  # stage 3: gather first
        return [p.detach().float().clone() for p in engine.module.parameters()]


def stage_matrix(cases: list[tuple[int, str, int]], steps: int = 3) -> dict:
    """Train every (stage, dtype, gas) case; return final params and comm stats per case."""
    world = torch.distributed.get_world_size()
    out = {}
    for stage, dtype, gas in cases:
        engine, *_ = zkit.initialize(model=make_model(), config=config(stage, dtype, gas, world))
        losses = train_engine(engine, steps, gas, world)
        out[(stage, dtype, gas)] = (params_of(engine), losses, engine.comm_stats())
        engine.close()
    return out


def clipped(clip: float, stage: int, steps: int = 3) -> list[torch.Tensor]:
    world = torch.distributed.get_world_size()
    engine, *_ = zkit.initialize(model=make_model(), config=config(stage, "fp32", 1, world, gradient_clipping=clip))
    train_engine(engine, steps, 1, world)
    return params_of(engine)


def fp16_overflow() -> dict:
    """A non-finite loss on one rank skips the step on every rank and halves the scale."""
    world = torch.distributed.get_world_size()
    cfg = config(2, "fp16", 1, world)
    cfg["fp16"]["hysteresis"] = 1
    engine, *_ = zkit.initialize(model=make_model(), config=cfg)
    before = params_of(engine)
    scale = engine.loss_scale
    ids, labels = global_batches(1, 1, world)
    loss = engine(ids[:2], labels[:2])
    if engine.rank == 1:
        loss = loss * float("inf")
    engine.backward(loss)
    engine.step()
    after = params_of(engine)
    return {
        "applied": engine.was_step_applied(),
        "skipped": engine.skipped_steps,
        "scale_before": scale,
        "scale_after": engine.loss_scale,
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, after)),
    }


def checkpoint_then_continue(path: str, stage: int, dtype: str = "fp32", gas: int = 1) -> dict:
    """Train 2 steps, save, train 2 more: the uninterrupted run to compare a resumed one with."""
    world = torch.distributed.get_world_size()
    cfg = config(stage, dtype, gas, world, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 3}})
    engine, *_ = zkit.initialize(model=make_model(), config=cfg)
    train_engine(engine, 2, gas, world)
    engine.save_checkpoint(path, client_state={"epoch": 7})
    losses = train_engine(engine, 2, gas, world, start=2)
    return {"losses": losses, "params": params_of(engine), "lr": engine.get_lr()}


def resume(path: str, stage: int, dtype: str = "fp32", gas: int = 1) -> dict:
    world = torch.distributed.get_world_size()
    cfg = config(stage, dtype, gas, world, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 3}})
    torch.manual_seed(999)  # a different init: everything must come from the checkpoint
    engine, *_ = zkit.initialize(model=TiedNet(), config=cfg)
    _, client = engine.load_checkpoint(path)
    steps = engine.global_steps
    losses = train_engine(engine, 2, gas, world, start=2)
    return {"losses": losses, "params": params_of(engine), "client": client, "steps": steps, "lr": engine.get_lr()}


def stage3_matrix(cases: list[tuple[str, int]], steps: int = 3, persistence: int = 0) -> dict:
    """Stage 3 (every unit released unless ``persistence``) for each (dtype, gas)."""
    world = torch.distributed.get_world_size()
    out = {}
    for dtype, gas in cases:
        cfg = config(3, dtype, gas, world)
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=persistence, stage3_prefetch_bucket_size=100)
        engine, *_ = zkit.initialize(model=make_model(), config=cfg)
        losses = train_engine(engine, steps, gas, world)
        params = params_of(engine)
        out[(dtype, gas)] = (params, losses, engine.comm_stats(), engine.memory())
        engine.close()
    return out


def stage3_user_code() -> dict:
    """Released parameters: a clear error outside the engine; GatheredParameters reads and edits."""
    from zkit.zero import GatheredParameters

    world = torch.distributed.get_world_size()
    cfg = config(3, "fp32", 1, world)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = zkit.initialize(model=make_model(), config=cfg)
    weight = engine.module.mix.weight
    out = {"shape": tuple(weight.shape)}
    try:
        weight.sum()
    except RuntimeError as exc:
        out["error"] = str(exc)
    with GatheredParameters([weight], modifier_rank=0):
        out["gathered_sum"] = float(weight.sum())
        if engine.rank == 0:
            with torch.no_grad():
                weight.fill_(0.5)
    with GatheredParameters([weight]):
        out["after_edit"] = float(weight.sum())
    # the edit reached the fp32 master too: one step of training starts from it
    train_engine(engine, 1, 1, world)
    with GatheredParameters([weight]):
        out["after_step_mean"] = float(weight.mean())
    return out


def stage3_built_with_init(steps: int = 3) -> list[torch.Tensor]:
    """A model constructed under zkit.zero.Init trains like one built whole."""
    from zkit.zero import GatheredParameters, Init

    world = torch.distributed.get_world_size()
    cfg = config(3, "fp32", 1, world)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    with Init(config=cfg):
        model = make_model()
    sizes = [p.data.untyped_storage().nbytes() for p in model.parameters()]
    engine, *_ = zkit.initialize(model=model, config=cfg)
    train_engine(engine, steps, 1, world)
    with GatheredParameters(list(engine.module.parameters())):
        return [params_of(engine), sizes]


def stage3_divergent_modules() -> str:
    """Rank 1 skips a module: the first forward names where the ranks diverge (per-module units:
    per block, the three layers are the root's one unit, gathered alike on both ranks)."""
    world = torch.distributed.get_world_size()
    cfg = config(3, "fp32", 1, world)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    cfg["zero_optimization"]["stage3_gather_unit"] = "module"

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)
            self.c = torch.nn.Linear(4, 4)

        def forward(self, x):
            x = self.a(x)
            if torch.distributed.get_rank() == 0:
                x = self.b(x)
            return self.c(x).sum()

    torch.manual_seed(0)
    engine, *_ = zkit.initialize(model=Branchy(), config=cfg)
    try:
        engine(torch.randn(2, 4))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def rank_and_world() -> tuple[int, int]:
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def fail_on_rank_one() -> None:
    if torch.distributed.get_rank() == 1:
        raise ValueError("rank one is broken")
    torch.distributed.barrier()  # rank 0 would wait here forever without the harness


def hang() -> None:
    import time

    time.sleep(3600)


def diverged_collectives() -> str:
    """Rank 0 all-reduces in the optimizer step while rank 1 waits for a message in backward."""
    from zkit.core.phases import phase
    from zkit.torch_distributed import diagnostics
    from zkit.torch_distributed.communicator import TorchCommunicator

    class Cfg:
        comms_timeout_s = 3.0

    comm = TorchCommunicator(None, Cfg())
    t = torch.ones(4)
    try:
        if comm.rank == 0:
            with phase("optimizer.step"):
                comm.all_reduce(t)
        else:
            with phase("backward of 'layers.3.mlp'"):
                comm.recv(t, src=0)
    except diagnostics.CollectiveFailed as exc:
        return str(exc)
    return "no error"


def rank_skips_collectives() -> str:
    """Rank 1 stops taking part (stuck in its own computation); rank 0's backward reduction
    ends at the timeout with a report instead of hanging."""
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _get_default_store

    from zkit.torch_distributed import diagnostics

    world = torch.distributed.get_world_size()
    cfg = config(0, "fp32", 1, world, comms_timeout_s=3.0)
    engine, *_ = zkit.initialize(model=make_model(), config=cfg)
    train_engine(engine, 1, 1, world)
    store = _get_default_store()
    if engine.rank == 1:
        # Out of every collective (a blocking store wait is no collective) until rank 0 has its
        # report: leaving earlier would close the group and fail rank 0 for another reason.
        store.wait(["rank 0 reported"], timedelta(seconds=60))
        return "rank 1 slept"
    try:
        train_engine(engine, 1, 1, world, start=1)
    except diagnostics.CollectiveFailed as exc:
        return str(exc)
    finally:
        store.set("rank 0 reported", "1")
    return "no error"


def overlapped_param_gather(cases: list[tuple[int, str, int]], steps: int = 3) -> dict:
    """Stages 1-2 with overlap_param_gather: per case the final parameters (read through
    state_dict, which must wait), the losses, and whether gathers were still in flight after the
    last step (they should be: the next forward or reader waits)."""
    world = torch.distributed.get_world_size()
    out = {}
    for stage, dtype, gas in cases:
        cfg = config(stage, dtype, gas, world)
        cfg["zero_optimization"]["overlap_param_gather"] = True
        engine, *_ = zkit.initialize(model=make_model(), config=cfg)
        losses = train_engine(engine, steps, gas, world)
        in_flight = bool(engine.partitioner.refresh.pending)
        state = engine.module.state_dict()
        params = [state[name].detach().float().clone() for name, _ in engine.module.named_parameters()]
        out[(stage, dtype, gas)] = (params, losses, in_flight)
        engine.close()
    return out


def overlapped_gather_readers() -> dict:
    """Every way of reading parameters after a step with gathers in flight waits for them."""
    world = torch.distributed.get_world_size()
    cfg = config(2, "fp32", 1, world)
    cfg["zero_optimization"]["overlap_param_gather"] = True
    seen = {}
    engine, *_ = zkit.initialize(model=make_model(), config=cfg)
    refresh = engine.partitioner.refresh
    for reader in ("submodule call", "wait_for_parameters", "GatheredParameters", "forward"):
        train_engine(engine, 1, 1, world)
        before = bool(refresh.pending)
        if reader == "submodule call":
            engine.module.mix(torch.zeros(1, 6))
        elif reader == "wait_for_parameters":
            engine.wait_for_parameters()
        elif reader == "GatheredParameters":
            from zkit.zero import GatheredParameters

            with GatheredParameters(list(engine.module.parameters())):
                pass
        else:
            ids, labels = global_batches(1, 1, world)
            engine(ids[:2], labels[:2])
        seen[reader] = (before, bool(refresh.pending))
    engine.close()
    return seen


def eval_batch_leaves_training_alone() -> dict:
    """engine.eval_batch: the mean forward loss of gas micro-batches, nothing trained."""
    world = torch.distributed.get_world_size()
    engine, *_ = zkit.initialize(model=make_model(), config=config(2, "fp32", 2, world))
    ids, labels = global_batches(1, 2, world)
    batches = [(ids[i * 2 : i * 2 + 2], labels[i * 2 : i * 2 + 2]) for i in range(2)]
    before = params_of(engine)
    loss = engine.eval_batch(iter(batches))
    with torch.no_grad():
        expected = torch.stack([engine(*b) for b in batches]).mean()
    out = {
        "loss": loss.item(), "expected": expected.item(), "training": engine.module.training,
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, params_of(engine))),
        "steps": engine.global_steps, "grads": [p.grad for p in engine.module.parameters() if p.grad is not None],
    }
    engine.close()
    return out


def gpt_built_with_init() -> float:
    """GPT re-initialises its children's weights in its own ``__init__``; under Init that runs on
    the gathered parameters. Returns the largest difference to the same GPT built whole."""
    from zkit.models.gpt import GPT, GPTConfig
    from zkit.zero import GatheredParameters, Init

    cfg = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16)
    torch.manual_seed(0)
    whole = [p.detach().clone() for p in GPT(cfg).parameters()]
    torch.manual_seed(torch.distributed.get_rank())  # other draws on rank 1: rank 0's are kept
    with Init():
        model = GPT(cfg)
    with GatheredParameters(list(model.parameters())):
        built = [p.detach().clone() for p in model.parameters()]
    return max((a - b).abs().max().item() for a, b in zip(built, whole))


def different_seeds() -> dict:
    """Each rank builds the model from its own seed (a script that never seeds): the engine trains
    rank 0's model on every rank."""
    import os

    torch.manual_seed(100 + int(os.environ.get("RANK", "0")))
    model = TiedNet()
    engine, *_ = zkit.initialize(model=model, config=config(0, "fp32", 1, 2))
    initial = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()]).clone()
    train_engine(engine, 2, 1, 2)
    final = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    engine.close()
    return {"initial": initial, "final": final}


def used_after_close(stage: int, save_dir: str) -> list[str]:
    """Close an engine after one step, then use it: what each use raises."""
    engine, *_ = zkit.initialize(model=make_model(), config=config(stage, "fp32", 1, 2))
    ids, labels = global_batches(1, 1, 2)
    loss = engine(ids[:2], labels[:2])
    engine.backward(loss)
    engine.step()
    engine.close()
    said = []
    for use in (lambda: engine(ids[:2], labels[:2]), lambda: engine.backward(loss), engine.step,
                lambda: engine.train_batch(iter([(ids[:2], labels[:2])])), lambda: engine.save_checkpoint(save_dir)):
        try:
            use()
            said.append("no error")
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            said.append(str(e))
    return said


def left_out_or_twice(stages: list[int]) -> list[str]:
    """At each ZeRO stage: what initialize says of model_parameters leaving out the model's
    ``norm`` and of one listing ``mix.weight`` in two groups."""
    said = []
    for stage in stages:
        for groups in (lambda m: [p for n, p in m.named_parameters() if not n.startswith("norm.")],
                       lambda m: [{"params": list(m.parameters())}, {"params": [m.mix.weight], "lr": 0.1}]):
            model = make_model()
            try:
                zkit.initialize(model=model, model_parameters=groups(model), config=config(stage, "fp32", 1, 2))
                said.append("accepted")
            except ValueError as e:
                said.append(str(e))
    return said
