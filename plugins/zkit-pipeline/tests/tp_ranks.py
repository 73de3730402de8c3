"""Rank functions of the tensor-parallel tests (module level so spawned ranks can import them)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zkit.torch_distributed.communicator import TorchCommunicator
from zkit_pipeline.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rng_tracker,
    model_parallel_seed,
    vocab_parallel_cross_entropy,
)
from zkit_pipeline.tp_gpt import TensorParallelGPTConfig, TensorParallelGPT


def _close(a, b, tol=1e-5):
    return torch.allclose(a, b, atol=tol, rtol=tol), float((a - b).abs().max())


def layers_match_dense() -> dict:
    comm = TorchCommunicator()
    rank, n = comm.rank, comm.world_size
    torch.manual_seed(0)
    dense1, dense2 = nn.Linear(8, 12), nn.Linear(12, 6)
    emb = nn.Embedding(16, 8)
    col = ColumnParallelLinear.from_dense(dense1, comm)
    row = RowParallelLinear.from_dense(dense2, comm)
    pemb = VocabParallelEmbedding.from_dense(emb, comm)
    ids = torch.randint(0, 16, (3, 5))
    out = {}
    # dense
    y = dense2(torch.relu(dense1(emb(ids))))
    y.square().sum().backward()
    # parallel
    yp = row(torch.relu(col(pemb(ids))))
    yp.square().sum().backward()
    out["forward"] = _close(y, yp)
    out["col_weight_grad"] = _close(dense1.weight.grad.chunk(n, 0)[rank], col.weight.grad)
    out["col_bias_grad"] = _close(dense1.bias.grad.chunk(n, 0)[rank], col.bias.grad)
    out["row_weight_grad"] = _close(dense2.weight.grad.chunk(n, 1)[rank], row.weight.grad)
    out["row_bias_grad"] = _close(dense2.bias.grad, row.bias.grad)
    out["embedding_grad"] = _close(emb.weight.grad.chunk(n, 0)[rank], pemb.weight.grad)
    # gather_output / input not parallel
    x = torch.randn(4, 8)
    colg = ColumnParallelLinear.from_dense(dense1, comm, gather_output=True)
    rowf = RowParallelLinear.from_dense(dense2, comm, input_is_parallel=False)
    out["gathered"] = _close(colg(x), dense1(x))
    out["scattered"] = _close(rowf(dense1(x)), dense2(dense1(x)))
    return out


def cross_entropy_matches_dense() -> dict:
    comm = TorchCommunicator()
    rank, n = comm.rank, comm.world_size
    torch.manual_seed(1)
    logits = torch.randn(6, 10, dtype=torch.float64, requires_grad=True) * 3
    logits.retain_grad()
    target = torch.randint(0, 10, (6,))
    ref = torch.nn.functional.cross_entropy(logits, target, reduction="none")
    ref.sum().backward()
    shard = logits.detach().chunk(n, -1)[rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(shard, target, comm)
    loss.sum().backward()
    return {
        "loss": _close(ref.float(), loss.float()),
        "grad": _close(logits.grad.chunk(n, -1)[rank].float(), shard.grad.float()),
    }


def dropout_masks() -> dict:
    comm = TorchCommunicator()
    model_parallel_seed(42, tensor_rank=comm.rank)
    replicated = torch.nn.functional.dropout(torch.ones(64), 0.5)
    with get_rng_tracker().fork():
        split = torch.nn.functional.dropout(torch.ones(64), 0.5)
    with get_rng_tracker().fork():
        split_again = torch.nn.functional.dropout(torch.ones(64), 0.5)
    masks = comm.all_gather_object((replicated, split))
    return {
        "replicated_same": bool(torch.equal(masks[0][0], masks[1][0])),
        "split_differs": not torch.equal(masks[0][1], masks[1][1]),
        "fork_advances": not torch.equal(split, split_again),
    }


def gpt_matches_dense(steps: int) -> dict:
    comm = TorchCommunicator()
    cfg = TensorParallelGPTConfig(vocab_size=64, seq_len=8, d_model=32, n_heads=4, n_layers=2)
    dense, parallel = TensorParallelGPT(cfg), TensorParallelGPT(cfg, comm)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (dense, parallel)]
    gen = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=gen)
        step = []
        for model, opt in zip((dense, parallel), opts):
            opt.zero_grad()
            loss = model.loss(model(ids[:, :-1]), ids[:, 1:])
            loss.backward()
            opt.step()
            step.append(loss.item())
        losses.append(step)
    return {"losses": losses}


def all_checks(steps: int) -> dict:
    """Every check above in one job: starting ranks costs far more than the checks."""
    return {
        "layers": layers_match_dense(),
        "cross_entropy": cross_entropy_matches_dense(),
        "dropout": dropout_masks(),
        "gpt": gpt_matches_dense(steps),
    }


def partition_activations_from_config() -> dict:
    """A TensorParallelModule engine whose config alone turns partition_activations on: the
    checkpointing settings split saved inputs over the model's tensor-parallel ranks."""
    import zkit
    from zkit.activations import recompute
    from zkit_pipeline.tensor_parallel.module import TensorParallelModule
    from zkit_pipeline.topology import ProcessGrid
    from zkit_pipeline.tp_gpt import TensorParallelGPTConfig, TensorParallelGPT

    cfg = TensorParallelGPTConfig(vocab_size=32, seq_len=8, n_layers=1, n_heads=2, d_model=16)
    module = TensorParallelModule(lambda tp: TensorParallelGPT(cfg, tp), ProcessGrid(data=1, tensor=2))
    engine, *_ = zkit.initialize(model=module, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "activation_checkpointing": {"partition_activations": True}})
    settings = recompute.settings()
    out = {"splits": settings.splits, "group_size": settings.group.world_size if settings.group else None}
    engine.close()
    recompute.reset()
    return out
