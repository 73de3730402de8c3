"""Rank functions of zkit-sequence's tests: a small Llama-style model (GQA) trained with the
sequence split over ``sp`` ranks, and the same model on the whole sequence in one process (plain
PyTorch) as the reference."""
from __future__ import annotations

from typing import Any

import torch

SEQ, VOCAB = 32, 64


def model_config(**overrides: Any):
    from zkit_sequence.llama import LlamaConfig

    fields = dict(vocab_size=VOCAB, n_layer=2, d_model=32, n_head=4, n_kv_head=2, ffn=48, max_seq_len=SEQ)
    return LlamaConfig(**{**fields, **overrides})


def build(**overrides: Any) -> torch.nn.Module:
    from zkit_sequence.llama import LlamaLM

    torch.manual_seed(0)
    return LlamaLM(model_config(**overrides))


def rank_batch(rank: int, index: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``index``-th batch of ``micro`` sequences: tokens and aligned labels, with a
    tail of ``-100`` (padding) of a different length per sequence, so slices hold unequal counts."""
    g = torch.Generator().manual_seed(1000 * rank + index)
    ids = torch.randint(0, VOCAB, (micro, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (micro, SEQ), generator=g)
    for row in range(micro):
        pad = int(torch.randint(0, SEQ // 2 + 3, (1,), generator=g))
        if pad:
            labels[row, SEQ - pad:] = -100
    labels[0, 1:5] = -100  # ignored tokens inside the sequence as well
    return ids, labels


def micro_batches(world: int, sp: int, micro_steps: int, micro: int) -> list[list[tuple]]:
    """The whole batches the run's micro-steps train on, per data-parallel replica: SequenceShards
    takes micro-step ``m`` of replica ``d`` from rank ``d * sp + m % sp``'s ``m // sp``-th batch."""
    return [[rank_batch(d * sp + m % sp, m // sp, micro) for d in range(world // sp)] for m in range(micro_steps)]


#: SGD with momentum: Adam would turn the rounding of a gradient element near zero (which the order of
#: the sums decides) into a whole step of the learning rate, hiding what the comparison checks
OPTIMIZER = {"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9}}


def engine_config(sp: int, stage: int, micro: int, accum: int, **extra: Any) -> dict:
    return {"sequence_parallel_size": sp, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accum, "optimizer": OPTIMIZER,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0},
            "steps_per_print": 1000, **extra}


def loader(rank: int, batches: int, micro: int) -> list[tuple]:
    return [rank_batch(rank, i, micro) for i in range(batches)]


def grads_of_one_step(sp: int, stage: int, model_options: dict, micro: int = 2) -> dict:
    """One micro-step: the loss and every parameter's reduced gradient, with the reference's."""
    import zkit
    from zkit.zero.full_state import get_full_grad
    from zkit_sequence import SequenceShards, sequence_communicator

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = build(**model_options)
    reference = build(**model_options)  # the same seed: the same weights
    engine, *_ = zkit.initialize(model=model, config=engine_config(sp, stage, micro, 1))
    data = iter(SequenceShards(loader(rank, 1, micro), sequence_communicator(engine)))
    ids, labels, positions = next(data)
    loss = engine(ids, labels, positions)
    engine.backward(loss)
    grads = {name: get_full_grad(p) for name, p in model.named_parameters()}
    stats = engine.comm_stats()
    seq_stats = sequence_communicator(engine).stats()
    engine.close()
    # the reference: each replica's whole batch on one process, the replicas' gradients averaged
    replicas = micro_batches(world, sp, 1, micro)[0]
    ref_losses = [reference(x, y) for x, y in replicas]
    ref_loss = torch.stack(ref_losses).mean()
    ref_loss.backward()
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}
    return {"loss": loss.item(), "ref_loss": ref_losses[rank // sp].item(), "grads": grads, "ref_grads": ref_grads,
            "shape": tuple(ids.shape), "positions": positions[0].tolist(), "stats": stats, "seq_stats": seq_stats}


def train_steps(sp: int, stage: int, model_options: dict, steps: int = 3, micro: int = 2, accum: int = 1,
                extra: dict | None = None) -> dict:
    """``steps`` optimizer steps; the parameters, with those of the same training in plain PyTorch."""
    import zkit
    from zkit.zero import GatheredParameters
    from zkit_sequence import SequenceShards, sequence_communicator

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = build(**model_options)
    reference = build(**model_options)  # the same seed: the same weights
    engine, *_ = zkit.initialize(model=model, config=engine_config(sp, stage, micro, accum, **(extra or {})))
    micro_steps = steps * accum
    data = iter(SequenceShards(loader(rank, -(-micro_steps // sp), micro), sequence_communicator(engine)))
    losses = []
    for _ in range(micro_steps):
        ids, labels, positions = next(data)
        loss = engine(ids, labels, positions)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with GatheredParameters(list(model.parameters())):
        params = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    engine.close()
    opt = torch.optim.SGD(reference.parameters(), **OPTIMIZER["params"])
    ref_losses = []
    for m, replicas in enumerate(micro_batches(world, sp, micro_steps, micro)):
        loss = torch.stack([reference(x, y) for x, y in replicas]).mean()
        (loss / accum).backward()
        ref_losses.append(loss.item())
        if (m + 1) % accum == 0:
            opt.step()
            opt.zero_grad()
    ref_params = {name: p.detach().clone() for name, p in reference.named_parameters()}
    return {"params": params, "ref_params": ref_params, "losses": losses, "ref_losses": ref_losses}


def refused(sp: int, model_options: dict) -> str:
    """The error initialize raises for a model the sequence-parallel ranks cannot split."""
    import zkit

    try:
        zkit.initialize(model=build(**model_options), config=engine_config(sp, 0, 1, 1))
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def freed_bytes_returned(sp: int) -> tuple[bool, int]:
    """After initialize: whether freed host memory goes back to the system (the policy fixed), and
    how much of 64 freed 4 MiB tensors, each made beside a small one that stays (as a step's
    transient activations sit between what it keeps), went back."""
    import gc

    import zkit
    from zkit.host_memory import return_freed_memory

    def rss() -> int:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))

    engine, *_ = zkit.initialize(model=build(), config=engine_config(sp, 0, 1, 1))
    t = torch.ones(1 << 20)
    del t  # a freed 4 MiB block: glibc's moving threshold (if left alone) now serves such blocks from the heap
    drop, keep = [], []
    for _ in range(64):
        drop.append(torch.ones(1 << 20))
        keep.append(torch.ones(16))
    before = rss()
    del drop
    gc.collect()
    returned = before - rss()
    applied = return_freed_memory()  # under auto and keep: whether it is fixed, asking nothing
    engine.close()
    return applied, returned
