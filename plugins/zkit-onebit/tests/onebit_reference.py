"""Single-process references of the 1-bit algorithms: plain float math on every simulated rank,
no bit packing and no communication, written from the papers' descriptions, to check the real
multi-rank implementations against."""
from __future__ import annotations

import torch


def _compress(rows: torch.Tensor, counts: torch.Tensor):
    """scale * sign of each row, scale = ||row|| / sqrt(count)."""
    scales = torch.linalg.vector_norm(rows, dim=1) / counts.clamp(min=1).sqrt()
    return torch.copysign(scales[:, None].expand_as(rows), rows)


def simulate_all_reduce(inputs, worker_errors, server_errors, live=None):
    """``inputs``: one flat tensor per rank. ``worker_errors[r]``: ``[W, C]``,
    ``server_errors[r]``: ``[1, C]`` (updated in place). ``live``: flat bool, the elements that
    carry data (the others are sent as zero, keep no error and come out zero). Returns the
    result (same on every rank)."""
    w = len(inputs)
    n = inputs[0].numel()
    dtype = inputs[0].dtype
    c = -(-n // (8 * w)) * 8
    keep = torch.zeros(w * c, dtype=torch.bool)
    keep[:n] = True if live is None else live
    keep = keep.view(w, c)
    counts = keep.sum(dim=1).to(dtype)
    sent = []
    for rank in range(w):
        x = torch.zeros(w * c, dtype=dtype)
        x[:n] = inputs[rank]
        x = torch.where(keep, x.view(w, c) + worker_errors[rank], 0.0)
        q = _compress(x, counts)
        worker_errors[rank].copy_(torch.where(keep, x - q, 0.0))
        sent.append(q)
    result = torch.zeros(w, c, dtype=dtype)
    for server in range(w):
        avg = torch.stack([sent[rank][server] for rank in range(w)]).mean(dim=0, keepdim=True)
        avg = torch.where(keep[server], avg + server_errors[server], 0.0)
        q = _compress(avg, counts[server : server + 1])
        server_errors[server].copy_(torch.where(keep[server], avg - q, 0.0))
        result[server] = torch.where(keep[server], q[0], 0.0)
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


def simulate_onebit_adam(x0, grads, steps, lr, betas, eps, weight_decay, freeze_step):
    """1-bit Adam (Tang et al., 2021) with Adam's bias correction, in float64.

    ``x0``: flat initial parameters; ``grads[t][r]``: flat gradient of rank ``r`` at step ``t``.
    Warm-up: AdamW on the averaged gradient. From ``freeze_step`` on: the variance and its bias
    correction are frozen; each rank updates its momentum with its local gradient, the momenta
    divided by the frozen denominator ``d = sqrt(v_hat) + eps`` are averaged by the compressed
    all-reduce, and the average replaces every rank's momentum. Elements with ``v = 0`` at the
    freeze stay put. Returns the parameters after every step."""
    b1, b2 = betas
    w = len(grads[0])
    x = x0.double().clone()
    m = torch.zeros_like(x)
    v = torch.zeros_like(x)
    n = x.numel()
    c = -(-n // (8 * w)) * 8
    werr = [torch.zeros(w, c, dtype=torch.float64) for _ in range(w)]
    serr = [torch.zeros(1, c, dtype=torch.float64) for _ in range(w)]
    out = []
    for t in range(1, steps + 1):
        g = [gr.double() for gr in grads[t - 1]]
        x = x * (1 - lr * weight_decay)
        if t <= freeze_step:
            avg = torch.stack(g).mean(dim=0)
            m = b1 * m + (1 - b1) * avg
            v = b2 * v + (1 - b2) * avg * avg
            x = x - lr / (1 - b1**t) * m / ((v / (1 - b2**t)).sqrt() + eps)
            if t == freeze_step:
                live = v != 0
                d = (v / (1 - b2**t)).sqrt() + eps
        else:
            local = [torch.where(live, (b1 * m + (1 - b1) * gr) / d, 0.0) for gr in g]
            y = simulate_all_reduce(local, werr, serr, live) if w > 1 else local[0]
            m = y * d
            x = x - lr / (1 - b1**t) * y
        out.append(x.clone())
    return out


def simulate_zero_one_adam(x0, grads, steps, lr, betas, eps, weight_decay, var_freeze_step, var_update_scaler,
                           local_step_scaler, local_step_clipper):
    """0/1 Adam (Lu et al., 2022) with Adam's bias correction, in float64; returns rank 0's
    parameters after every step.

    Steps ``1 .. var_freeze_step``: on variance steps (``t % var_interval == 0``) Adam on the
    averaged gradient, the error buffers rescaled by ``d_old / d_new``; otherwise the momentum
    takes the compressed average of ``g / d``; ``var_interval`` doubles every ``var_update_scaler``
    variance steps. Afterwards: local steps with local momenta; every ``local_interval`` steps the
    moves since the last synchronisation are averaged compressed (error buffers restarted at the
    freeze), every rank moves to the synchronisation point plus the average, and the momentum is
    set to ``-average * d / (sum of step sizes)``."""
    b1, b2 = betas
    w = len(grads[0])
    n = x0.numel()
    c = -(-n // (8 * w)) * 8
    xs = [x0.double().clone() for _ in range(w)]
    ms = [torch.zeros(n, dtype=torch.float64) for _ in range(w)]
    v = torch.zeros(n, dtype=torch.float64)
    updates = 0
    werr = [torch.zeros(w, c, dtype=torch.float64) for _ in range(w)]
    serr = [torch.zeros(1, c, dtype=torch.float64) for _ in range(w)]
    var_interval, var_counter, local_interval, local_counter = 1, 0, 1, 0
    frozen, lrs, sync = False, 0.0, None

    def denom():
        return (v / (1 - b2 ** max(updates, 1))).sqrt() + eps

    def rescale(ratio):
        for r in range(w):
            werr[r].view(-1)[:n] *= ratio
            lo, count = r * c, min(max(n - r * c, 0), c)
            serr[r][0, :count] *= ratio[lo : lo + count]

    out = []
    for t in range(1, steps + 1):
        g = [gr.double() for gr in grads[t - 1]]
        step = lr / (1 - b1**t)
        if not frozen:
            if t % var_interval == 0:
                avg = torch.stack(g).mean(dim=0)
                live_old, d_old = v != 0, denom()
                ms = [b1 * m + (1 - b1) * avg for m in ms]
                v = b2 * v + (1 - b2) * avg * avg
                updates += 1
                rescale(torch.where(live_old, d_old / denom(), 0.0))
                var_counter += 1
                if var_counter == var_update_scaler:
                    var_counter, var_interval = 0, 2 * var_interval
            else:
                live, d = v != 0, denom()
                y = simulate_all_reduce([torch.where(live, gr / d, 0.0) for gr in g], werr, serr, live)
                ms = [b1 * m + (1 - b1) * y * d for m in ms]
            live, d = v != 0, denom()
            xs = [x * (1 - lr * weight_decay) - step * torch.where(live, m / d, 0.0) for x, m in zip(xs, ms)]
            if t >= var_freeze_step:
                frozen = True
                werr = [torch.zeros_like(e) for e in werr]
                serr = [torch.zeros_like(e) for e in serr]
                sync = xs[0].clone()
        else:
            ms = [b1 * m + (1 - b1) * gr for m, gr in zip(ms, g)]
            xs = [x * (1 - lr * weight_decay) - step * torch.where(live, m / d, 0.0) for x, m in zip(xs, ms)]
            lrs += step
            if t % local_interval == 0:
                delta = simulate_all_reduce([x - sync for x in xs], werr, serr, live)
                sync = sync + delta
                xs = [sync.clone() for _ in range(w)]
                ms = [torch.where(live, -delta * d / lrs, 0.0) for _ in range(w)]
                lrs = 0.0
            local_counter += 1
            if local_counter == local_step_scaler:
                local_counter, local_interval = 0, min(local_step_clipper, 2 * local_interval)
        out.append(xs[0].clone())
    return out
