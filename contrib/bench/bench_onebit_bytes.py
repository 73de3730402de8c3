"""Wire bytes per step per rank, Adam vs 1-bit Adam, from the communicator's byte counters.

Trains the byte-level GPT (``zkit.models.gpt``, preset ``small``, 4.8M parameters) on the example
corpus through ``zkit.initialize`` on gloo ranks over loopback, and reads ``engine.comm_stats()``
after every step: Adam (fp32 gradient all-reduce every step), 1-bit Adam in warm-up and in the
compressed phase, for ZeRO stage 0 and stage 1. Reports the compressed-phase reduction and the
overall reduction of a run with 15% warm-up.

    python contrib/bench/bench_onebit_bytes.py --world 2 4 --out runs/bench_onebit
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_onebit_common import CORPUS, config_for, lm_loss, train_steps, write_csv  # noqa: E402


def run(optimizer: str, stage: int, warmup: int, compressed: int) -> list[dict]:
    import torch.distributed as dist

    import zkit
    from zkit.data.text import ByteTextDataset
    from zkit.models.gpt import GPT, GPTConfig

    import torch

    torch.manual_seed(0)
    cfg = GPTConfig.preset("small")
    model = GPT(cfg)
    data = ByteTextDataset(CORPUS, cfg.seq_len)
    rank, world = dist.get_rank(), dist.get_world_size()

    def batches(step):
        idx = [(step * world + rank) * 2 + i for i in range(2)]
        xs, ys = zip(*(data[i] for i in idx))
        return torch.stack(xs), torch.stack(ys)

    engine, *_ = zkit.initialize(model=model, config=config_for(optimizer, 1e-3, warmup, stage, micro_batch=2))
    rows = train_steps(engine, batches, warmup + compressed, lm_loss)
    engine.close()
    for row in rows:
        row["phase"] = "warmup" if optimizer == "OneBitAdam" and row["step"] <= warmup else (
            "compressed" if optimizer == "OneBitAdam" else "adam")
        row["params"] = sum(p.numel() for p in model.parameters())
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--out", default="runs/bench_onebit")
    args = ap.parse_args()
    from zkit.testing import run_ranks

    summary = []
    for world in args.world:
        for stage in args.stages:
            adam = run_ranks(run, world, args=("Adam", stage, 0, 2), timeout=900)[0]
            onebit = run_ranks(run, world, args=("OneBitAdam", stage, 2, 2), timeout=900)[0]
            write_csv(f"{args.out}/bytes_w{world}_s{stage}.csv", adam + onebit)
            per = {
                phase: sum(r["bytes"] for r in rows) / len(rows)
                for phase, rows in (
                    ("adam", adam),
                    ("warmup", [r for r in onebit if r["phase"] == "warmup"]),
                    ("compressed", [r for r in onebit if r["phase"] == "compressed"]),
                )
            }
            overall = (0.15 * per["warmup"] + 0.85 * per["compressed"]) / per["adam"]
            summary.append((world, stage, adam[0]["params"], per, per["adam"] / per["compressed"], 1 / overall))
    print("| ranks | ZeRO | params | Adam B/step | 1-bit warm-up B/step | 1-bit compressed B/step | "
          "compressed reduction | 15% warm-up overall |")
    print("|---|---|---|---|---|---|---|---|")
    for world, stage, n, per, red, overall in summary:
        print(f"| {world} | {stage} | {n:,} | {per['adam']:,.0f} | {per['warmup']:,.0f} | {per['compressed']:,.0f} | "
              f"{red:.1f}x | {overall:.1f}x |")


if __name__ == "__main__":
    main()
