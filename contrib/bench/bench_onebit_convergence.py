"""Convergence on the example corpus (next-byte prediction), Adam vs 1-bit Adam (15% warm-up) vs
0/1 Adam (variance refreshed up to 50% of the steps) vs Adam over the ``onebit``
gradient-compression communicator, on gloo ranks over loopback. Models: the
repo's byte-level GPT (``--model gpt``, preset ``--preset``) or a byte-level MLP language model
(``--model mlp``: the previous 16 bytes, embedded, through a 2-layer MLP).

Every run sees the same batches in the same order. Reports the final training loss (mean of the
last 10% of steps) and the validation loss of each, relative to Adam's, and writes the curves as
CSV (and a PNG when matplotlib is installed).

    python contrib/bench/bench_onebit_convergence.py --steps 400 --world 2 --out runs/bench_onebit
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_onebit_common import CORPUS, config_for, lm_loss, train_steps, write_csv  # noqa: E402


def byte_mlp(context: int = 16, dim: int = 32, hidden: int = 512):
    """Next byte from the previous ``context`` bytes: embedding, 2-layer MLP."""
    import torch
    from torch import nn

    class ByteMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(256, dim)
            self.mlp = nn.Sequential(nn.Linear(context * dim, hidden), nn.GELU(), nn.Linear(hidden, 256))

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            logits = self.mlp(self.embed(input_ids[:, -context:]).flatten(1))
            return nn.functional.cross_entropy(logits.float(), labels[:, -1])

    return ByteMLP()


RUNS = ("adam", "onebitadam", "zerooneadam", "adam+onebit-comm")
OPTIMIZERS = {"onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam"}


def run(
    name: str, steps: int, warmup: dict[str, int], preset: str, micro_batch: int, lr: float, kind: str = "gpt"
) -> dict:
    import torch
    import torch.distributed as dist

    import zkit
    from zkit.data.text import ByteTextDataset
    from zkit.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    if kind == "gpt":
        cfg = GPTConfig.preset(preset)
        model, seq_len = GPT(cfg), cfg.seq_len
    else:
        model, seq_len = byte_mlp(), 16
    train = ByteTextDataset(CORPUS, seq_len)
    val = ByteTextDataset(CORPUS, seq_len, split="val")
    rank, world = dist.get_rank(), dist.get_world_size()
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(1))

    def batches(step):
        start = (step * world + rank) * micro_batch
        xs, ys = zip(*(train[int(i)] for i in order[start : start + micro_batch]))
        return torch.stack(xs), torch.stack(ys)

    optimizer = OPTIMIZERS.get(name, "Adam")
    stack = zkit.Stack(communicator="onebit") if name == "adam+onebit-comm" else None
    engine, *_ = zkit.initialize(
        model=model, config=config_for(optimizer, lr, warmup[name], 0, micro_batch), stack=stack
    )
    rows = train_steps(engine, batches, steps, lm_loss)
    engine.eval()
    with torch.no_grad():
        idx = range(rank, min(len(val), 512 * world), world)
        xs, ys = zip(*(val[i] for i in idx))
        val_loss = engine(torch.stack(xs), labels=torch.stack(ys)).detach()
    dist.all_reduce(val_loss)
    engine.close()
    return {"rows": rows, "val": val_loss.item() / world}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup-fraction", type=float, default=0.15)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--model", choices=["gpt", "mlp"], default="gpt")
    ap.add_argument("--preset", default="tiny", help="GPT preset")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--out", default="runs/bench_onebit")
    ap.add_argument("--var-freeze-fraction", type=float, default=0.5, help="0/1 Adam's var_freeze_step")
    ap.add_argument("--runs", default="adam,onebitadam,zerooneadam,adam+onebit-comm",
                    help=f"comma-separated runs out of {', '.join(RUNS)}")
    args = ap.parse_args()
    from zkit.testing import run_ranks

    names = args.runs.split(",")
    if set(names) - set(RUNS) or "adam" not in names:
        ap.error(f"--runs must include 'adam' and name only {', '.join(RUNS)}; got {args.runs!r}")
    freeze = max(1, round(args.steps * args.warmup_fraction))
    warmup = {n: freeze for n in RUNS}
    warmup["zerooneadam"] = max(1, round(args.steps * args.var_freeze_fraction))
    results = {
        n: run_ranks(run, args.world, args=(n, args.steps, warmup, args.preset, args.micro_batch, args.lr,
                                             args.model), timeout=3600)[0]
        for n in names
    }
    curve = [
        {"step": i + 1, **{f"loss_{n}": results[n]["rows"][i]["loss"] for n in names}}
        for i in range(args.steps)
    ]
    model_tag = f"gpt_{args.preset}" if args.model == "gpt" else "mlp"
    tag = f"{model_tag}_lr{args.lr:g}_{args.steps}"
    write_csv(f"{args.out}/convergence_{tag}.csv", curve)
    tail = max(1, args.steps // 10)
    final = {n: sum(r["loss"] for r in results[n]["rows"][-tail:]) / tail for n in names}
    mb = {n: sum(r["bytes"] for r in results[n]["rows"]) / 1e6 for n in names}
    model = f"GPT {args.preset}" if args.model == "gpt" else "byte MLP"
    print(f"{model}, {args.world} ranks, {args.steps} steps, lr {args.lr:g}, 1-bit Adam freeze_step {freeze}, "
          f"0/1 Adam var_freeze_step {warmup['zerooneadam']}")
    print("| run | final train loss | vs Adam | val loss | vs Adam | MB sent per rank (whole run) |")
    print("|---|---|---|---|---|---|")
    for n in names:
        print(f"| {n} | {final[n]:.4f} | {100 * (final[n] / final['adam'] - 1):+.2f}% | {results[n]['val']:.4f} | "
              f"{100 * (results[n]['val'] / results['adam']['val'] - 1):+.2f}% | {mb[n]:.1f} |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG, the curves are in the CSV")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for n in names:
        ax.plot([r["step"] for r in curve], [r[f"loss_{n}"] for r in curve], label=n, linewidth=0.8)
    ax.axvline(freeze, color="grey", linestyle=":", label="freeze_step")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{args.out}/convergence_{tag}.png", dpi=120)


if __name__ == "__main__":
    main()
