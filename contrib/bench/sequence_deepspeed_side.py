"""DeepSpeed's Ulysses as a contestant of ``bench_sequence.py --longest``, run in DeepSpeed's own
interpreter (see :func:`zero_deepspeed_side.deepspeed_command`).

The same Llama-style model as zkit-sequence's (RMSNorm, rotary positions, 4 query and 2 key-value
heads, SwiGLU, same sizes), written here with DeepSpeed's pieces: ``deepspeed.sequence.layer.
DistributedAttention`` around torch's ``scaled_dot_product_attention`` (the key-value heads repeated
to one per rank first, as ``UlyssesSPAttentionHF`` does), the sequence groups of
``deepspeed.runtime.sequence_parallel.parallel_state_sp`` given to ``deepspeed.initialize`` as its
``mpu``, ZeRO-3 and torch's AdamW, the loss summed over each rank's tokens and all-reduced over the
sequence group. ``alst``: DeepSpeed's ``TiledMLP`` and ``TiledFusedLogitsLoss`` and its activation
checkpointing of each block. Without ``cpu_checkpointing``: on the CPU DeepSpeed 0.19.8's copy of a
checkpoint to the host is the input tensor itself (``.to("cpu")`` of a CPU tensor), whose data it then
empties (``get_cpu_activations_for_backward``), so the recomputation gets a 0-dim input and fails
(``rms_norm: Input tensor must have at least 1 dimensions, but got 0``); on the CPU the checkpoints
are in host memory anyway. One step at ``seq`` tokens under a resident-set cap::

    DS_ACCELERATOR=cpu /path/to/ds-venv/bin/python contrib/bench/sequence_deepspeed_side.py \
        --seq 8192 --rss-cap 734003200 [--alst]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULT_PREFIX = "SEQUENCE_BENCH_RESULT "
SP = 4


def _model(cfg: dict, alst: bool, mlp_tiles: int, loss_tiles: int) -> Any:
    import deepspeed
    import torch
    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP
    from deepspeed.sequence.layer import DistributedAttention
    from torch import nn

    d, heads, kv_heads, hd = cfg["d_model"], cfg["n_head"], cfg["n_kv_head"], cfg["d_model"] // cfg["n_head"]
    group = parallel_state_sp.get_sequence_parallel_group()

    def rotate(x, position_ids):  # x [b, s, heads, d]
        half = x.shape[-1] // 2
        freqs = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
        angles = position_ids.float()[:, :, None, None] * freqs
        cos, sin = angles.cos(), angles.sin()
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def local_attention(q, k, v, *args, **kwargs):  # [b, s, heads / P, d]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(d, heads * hd, bias=False)
            self.kv = nn.Linear(d, 2 * kv_heads * hd, bias=False)
            self.o = nn.Linear(heads * hd, d, bias=False)
            self.core = DistributedAttention(local_attention, group, scatter_idx=2, gather_idx=1)

        def forward(self, x, position_ids):
            b, s, _ = x.shape
            q = rotate(self.q(x).view(b, s, heads, hd), position_ids)
            k, v = self.kv(x).view(b, s, 2, kv_heads, hd).unbind(2)
            k = rotate(k, position_ids)
            # one key-value head per rank at least, then every local query head its key-value head
            k, v = (t.repeat_interleave(heads // kv_heads, dim=2) for t in (k, v))
            return self.o(self.core(q, k, v, 0).reshape(b, s, -1))

    class SwiGLU(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(d, cfg["ffn"], bias=False)
            self.up = nn.Linear(d, cfg["ffn"], bias=False)
            self.down = nn.Linear(cfg["ffn"], d, bias=False)

        def forward(self, x):
            if alst:
                return TiledMLP.apply(lambda m, t: m.down(F.silu(m.gate(t)) * m.up(t)), self, x, mlp_tiles,
                                      [self.gate.weight, self.up.weight, self.down.weight])
            return self.down(F.silu(self.gate(x)) * self.up(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm, self.attn = nn.RMSNorm(d), Attention()
            self.mlp_norm, self.mlp = nn.RMSNorm(d), SwiGLU()

        def forward(self, x, position_ids):
            x = x + self.attn(self.attn_norm(x), position_ids)
            return x + self.mlp(self.mlp_norm(x))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(cfg["vocab_size"], d)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg["n_layer"]))
            self.norm = nn.RMSNorm(d)
            self.head = nn.Linear(d, cfg["vocab_size"], bias=False)

        def forward(self, ids, labels, position_ids):
            x = self.embed(ids)
            for block in self.blocks:
                if alst:
                    x = deepspeed.checkpointing.checkpoint(block, x, position_ids)
                else:
                    x = block(x, position_ids)
            x = self.norm(x)
            if alst:
                loss_sum = TiledFusedLogitsLoss.apply(
                    lambda m, h, y: F.cross_entropy(m.head(h).float().view(-1, cfg["vocab_size"]), y.view(-1),
                                                    reduction="sum"),
                    self, x, labels, None, loss_tiles, [self.head.weight], "sum")
            else:
                loss_sum = F.cross_entropy(self.head(x).float().view(-1, cfg["vocab_size"]), labels.view(-1),
                                           reduction="sum")
            both = torch.stack([loss_sum, torch.tensor(float(labels.numel()))])
            both = torch.distributed.nn.functional.all_reduce(both, group=group)
            return both[0] / both[1]

    torch.manual_seed(0)
    return LM()


def longest_ranks(seq: int, cfg: dict, cap: int, alst: bool, mlp_tiles: int, loss_tiles: int) -> dict:
    import deepspeed
    import torch
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    from zero_workloads import RssGuard, peak_rss_bytes, rss_bytes

    torch.set_num_threads(1)
    guard = RssGuard(cap)
    deepspeed.init_distributed(dist_backend="gloo")
    parallel_state_sp.initialize_sequence_parallel(SP)
    config = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": SP, "steps_per_print": 10 ** 6,
              "zero_optimization": {"stage": 3, "reduce_bucket_size": 1 << 20, "stage3_prefetch_bucket_size": 1 << 20,
                                    "stage3_max_live_parameters": 1 << 20, "stage3_param_persistence_threshold": 0},
              "activation_checkpointing": {"cpu_checkpointing": False, "partition_activations": False}}
    model = _model(cfg, alst, mlp_tiles, loss_tiles)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config, mpu=parallel_state_sp,
                                      dist_init_required=False)
    if alst:
        deepspeed.checkpointing.configure(parallel_state_sp, deepspeed_config=config)
    base = rss_bytes()
    g = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(0, cfg["vocab_size"], (1, seq), generator=g) for _ in range(2))
    positions = torch.arange(seq)[None]
    rank, part = parallel_state_sp.get_sequence_parallel_rank(), seq // SP
    mine = [t[:, rank * part:(rank + 1) * part] for t in (ids, labels, positions)]
    start = time.perf_counter()
    loss = engine(*mine)
    engine.backward(loss)
    engine.step()
    took = time.perf_counter() - start
    guard.stop()
    engine.destroy()
    return {"base": base, "step_s": took, "peak": peak_rss_bytes()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--rss-cap", type=int, required=True, help="per-rank resident-set cap in bytes")
    p.add_argument("--model", required=True, help="JSON of the model's sizes (bench_sequence.LONG_MODEL)")
    p.add_argument("--alst", action="store_true", help="TiledMLP, TiledFusedLogitsLoss, checkpointed blocks")
    p.add_argument("--mlp-tiles", type=int, default=8)
    p.add_argument("--loss-tiles", type=int, default=16)
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    sys.path[:0] = [HERE, REPO]
    from zkit.testing import run_ranks

    results = run_ranks(longest_ranks, SP, args=(args.seq, json.loads(args.model), args.rss_cap, args.alst,
                                                 args.mlp_tiles, args.loss_tiles), timeout=args.timeout)
    print(RESULT_PREFIX + json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
