"""A single-process reference of the compressed all-reduce: plain float math on every simulated
rank, no bit packing and no communication, to check the real multi-rank implementation against."""
from __future__ import annotations

import torch


def _compress(rows: torch.Tensor, counts: torch.Tensor):
    """scale * sign of each row, scale = ||row|| / sqrt(count)."""
    scales = torch.linalg.vector_norm(rows, dim=1) / counts.clamp(min=1).sqrt()
    return torch.copysign(scales[:, None].expand_as(rows), rows)


def simulate_all_reduce(inputs, worker_errors, server_errors):
    """``inputs``: one flat fp32 tensor per rank. ``worker_errors[r]``: ``[W, C]``,
    ``server_errors[r]``: ``[1, C]`` (updated in place). Returns the result (same on every rank)."""
    w = len(inputs)
    n = inputs[0].numel()
    c = -(-n // (8 * w)) * 8
    counts = torch.tensor([min(max(n - r * c, 0), c) for r in range(w)], dtype=torch.float32)
    pad = torch.arange(w * c).view(w, c) >= n
    sent = []
    for rank in range(w):
        x = torch.zeros(w * c)
        x[:n] = inputs[rank]
        x = x.view(w, c) + worker_errors[rank]
        q = _compress(x, counts)
        worker_errors[rank].copy_(torch.where(pad, 0.0, x - q))
        sent.append(q)
    result = torch.zeros(w, c)
    for server in range(w):
        avg = torch.stack([sent[rank][server] for rank in range(w)]).mean(dim=0, keepdim=True)
        avg = torch.where(pad[server], 0.0, avg) + server_errors[server]
        q = _compress(avg, counts[server : server + 1])
        server_errors[server].copy_(torch.where(pad[server], 0.0, avg - q))
        result[server] = q[0]
    return result.view(-1)[:n]


def simulate_reduce_scatter(inputs, worker_errors):
    """Phase 1 only: rank r's averaged shard, for each r (``worker_errors[r]``: ``[W, C]``)."""
    w = len(inputs)
    k = inputs[0].numel() // w
    c = -(-k // 8) * 8
    counts = torch.full((w,), float(k))
    sent = []
    for rank in range(w):
        x = torch.zeros(w, c)
        x[:, :k] = inputs[rank].view(w, k)
        x = x + worker_errors[rank]
        q = _compress(x, counts)
        err = x - q
        err[:, k:] = 0
        worker_errors[rank].copy_(err)
        sent.append(q)
    return [torch.stack([sent[rank][server] for rank in range(w)]).mean(dim=0)[:k] for server in range(w)]
