"""Ulysses sequence parallelism: the all-to-all bytes of a step against the formula, and the longest
sequence each setup trains under a per-rank memory cap.

* ``--bytes``: one training step of zkit-sequence's Llama-style model (multi-head: the formula's
  case) at sequence-parallel sizes 2 and 4, the sequence group's all-to-all bytes read from its
  communicator's counters, against the formula: 4 all-to-alls per layer in forward (queries, keys,
  values, output) and 4 in backward, each of ``b * s * h / P`` elements on each rank, of which a
  ring-counting communicator counts ``(P - 1) / P`` as sent.
* ``--longest``: a small Llama-style model with grouped-query attention (2 layers, width 64, 4
  query and 2 key-value heads, a vocabulary of 8000) on 4 ranks, one sample per step; for each setup, sequences of 1024, 2048, ... tokens until
  one does not train a step with every rank's resident set under ``--cap-mib`` (each rank stops
  itself past it: ``zero_workloads.RssGuard``). Setups: plain data parallelism (each rank the whole
  sequence), Ulysses 4, Ulysses 4 with the tiled MLP and tiled logits + loss and activation
  checkpoints offloaded to the host (``cpu_checkpointing``), and Ulysses 4 with zkit-sparse's
  block-sparse attention (fixed layout) inside.

    OMP_NUM_THREADS=1 python contrib/bench/bench_sequence.py --bytes
    OMP_NUM_THREADS=1 python contrib/bench/bench_sequence.py --longest --cap-mib 700 --start 2048 --limit 32768
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MIB = 1 << 20


def _model(**overrides):
    from zkit_sequence.llama import LlamaConfig, LlamaLM
    import torch

    torch.manual_seed(0)
    return LlamaLM(LlamaConfig(**overrides))


def _config(sp: int, extra: dict | None = None) -> dict:
    return {"sequence_parallel_size": sp, "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 3},
            "steps_per_print": 10 ** 6, **(extra or {})}


def _step(engine, seq: int, vocab: int, sp: int) -> None:
    import torch

    from zkit_sequence import sequence_communicator, shard, with_positions

    g = torch.Generator().manual_seed(0)
    batch = with_positions((torch.randint(0, vocab, (1, seq), generator=g),
                            torch.randint(0, vocab, (1, seq), generator=g)))
    if sp > 1:
        comm = sequence_communicator(engine)
        batch = shard(batch, comm.rank, comm.world_size)
    ids, labels, positions = batch
    loss = engine(ids, labels, positions)
    engine.backward(loss)
    engine.step()


# -- bytes ------------------------------------------------------------------------------------------
BYTES_MODEL = dict(vocab_size=256, n_layer=2, d_model=64, n_head=4, n_kv_head=4, ffn=128, max_seq_len=4096)


def bytes_rank(seq: int) -> dict:
    import torch

    import zkit
    from zkit_sequence import sequence_communicator

    world = torch.distributed.get_world_size()
    engine, *_ = zkit.initialize(model=_model(**BYTES_MODEL), config=_config(world))
    comm = sequence_communicator(engine)
    comm.reset_stats()
    _step(engine, seq, BYTES_MODEL["vocab_size"], world)
    stats = comm.stats().get("all_to_all", {"calls": 0, "bytes": 0})
    engine.close()
    return stats


def bytes_mode(seq: int) -> list[str]:
    from zkit.testing import run_ranks

    b, h, layers = 1, BYTES_MODEL["d_model"], BYTES_MODEL["n_layer"]
    rows = ["| sequence-parallel size | tokens | all-to-alls per step | bytes sent per rank (counters) | formula "
            "8 x layers x (P-1)/P x b*s*h/P x 4 B | ratio |", "|---|---|---|---|---|---|"]
    for p in (2, 4):
        stats = run_ranks(bytes_rank, p, args=(seq,), timeout=600)
        formula = 8 * layers * (p - 1) * (b * seq * h // p) * 4 // p
        measured = stats[0]["bytes"]
        assert all(s == stats[0] for s in stats), stats
        rows.append(f"| {p} | {seq} | {stats[0]['calls']} | {measured:,} | {formula:,} | {measured / formula:.3f} |")
    return rows


# -- longest sequence --------------------------------------------------------------------------------
LONG_MODEL = dict(vocab_size=8000, n_layer=2, d_model=64, n_head=4, n_kv_head=2, ffn=192, max_seq_len=1 << 17)
SETUPS = {
    "data parallel (4 replicas)": (1, {}, {}),
    "Ulysses 4": (4, {}, {}),
    "Ulysses 4 + tiled MLP and loss + checkpoints to host": (
        4, {"mlp_tiles": 8, "loss_tiles": 16, "checkpoint_blocks": True},
        {"activation_checkpointing": {"cpu_checkpointing": True}}),
    "Ulysses 4 + block-sparse attention": (
        4, {"attention": "block_sparse", "attention_kwargs": {"mode": "fixed", "block": 64, "num_local_blocks": 4}},
        {}),
}


def longest_rank(seq: int, sp: int, model_options: dict, extra: dict, cap: int) -> dict:
    from zero_workloads import RssGuard, rss_bytes

    import zkit

    guard = RssGuard(cap)
    engine, *_ = zkit.initialize(model=_model(**{**LONG_MODEL, **model_options}), config=_config(sp, extra))
    base = rss_bytes()
    start = time.perf_counter()
    _step(engine, seq, LONG_MODEL["vocab_size"], sp)
    took = time.perf_counter() - start
    guard.stop()
    engine.close()
    return {"base": base, "step_s": took}


def longest_mode(cap_mib: int, start: int, limit: int, setups: list[str]) -> list[str]:
    from zkit.testing import RanksFailed, RanksTimedOut, run_ranks

    rows = [f"| setup (4 ranks, cap {cap_mib} MiB resident per rank) | longest sequence | x data parallel | "
            "step at that length |", "|---|---|---|---|"]
    dp = None
    for name in setups:
        sp, model_options, extra = SETUPS[name]
        best, seq, step_s = 0, start, 0.0
        while seq <= limit:
            try:
                out = run_ranks(longest_rank, 4, args=(seq, sp, model_options, extra, cap_mib * MIB), timeout=900,
                                start="spawn")
            except (RanksFailed, RanksTimedOut) as exc:
                print(f"{name}: {seq} tokens: {str(exc).splitlines()[0]}", flush=True)
                break
            best, step_s = seq, max(r["step_s"] for r in out)
            print(f"{name}: {seq} tokens trained ({step_s:.1f} s; resident after initialize "
                  f"{max(r['base'] for r in out) / MIB:.0f} MiB)", flush=True)
            seq *= 2
        dp = best if dp is None else dp
        reached = f"{best:,}" + ("+" if seq > limit else "")
        rows.append(f"| {name} | {reached} | {best / dp:.1f} | {step_s:.1f} s |" if dp else f"| {name} | {reached} | | |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", action="store_true", help="all-to-all bytes against the formula")
    p.add_argument("--longest", action="store_true", help="longest sequence under the memory cap")
    p.add_argument("--seq", type=int, default=1024, help="tokens of the --bytes step")
    p.add_argument("--cap-mib", type=int, default=700, help="resident memory cap per rank (--longest)")
    p.add_argument("--start", type=int, default=2048, help="first sequence length tried")
    p.add_argument("--limit", type=int, default=1 << 15, help="longest sequence length tried")
    p.add_argument("--setups", default=",".join(SETUPS), help="comma-separated setup names (--longest)")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.bytes:
        print("\n".join(bytes_mode(args.seq)))
    if args.longest:
        print("\n".join(longest_mode(args.cap_mib, args.start, args.limit, args.setups.split(","))))


if __name__ == "__main__":
    main()
