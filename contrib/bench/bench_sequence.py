"""Ulysses sequence parallelism: the all-to-all bytes of a step against the formula, and the longest
sequence each setup trains under a per-rank memory cap.

* ``--bytes``: one training step of zkit-sequence's Llama-style model (multi-head: the formula's
  case) at sequence-parallel sizes 2 and 4, the sequence group's all-to-all bytes read from its
  communicator's counters, against the formula: 4 all-to-alls per layer in forward (queries, keys,
  values, output) and 4 in backward, each of ``b * s * h / P`` elements on each rank, of which a
  ring-counting communicator counts ``(P - 1) / P`` as sent.
* ``--longest``: a small Llama-style model with grouped-query attention (2 layers, width 64, 4
  query and 2 key-value heads, a vocabulary of 8000) on 4 ranks, one sample per step; for each
  setup, sequences of ``--start``, twice that, ... tokens until one does not train a step with every
  rank's resident set under ``--cap-mib`` (each rank stops itself past it:
  ``zero_workloads.RssGuard``). Setups: plain data parallelism (each rank the whole sequence),
  Ulysses 4, Ulysses 4 with the tiled MLP and tiled logits + loss and activation checkpoints
  offloaded to the host (``cpu_checkpointing``), the same with zkit-sparse's block-sparse attention
  (a sliding window) inside, and DeepSpeed 0.19.8's Ulysses (``DistributedAttention``; with its
  ``TiledMLP``, ``TiledFusedLogitsLoss`` and checkpointed blocks) on the same model in DeepSpeed's
  interpreter (``--deepspeed-python``; ``sequence_deepspeed_side.py``). ``--plot``: the peak
  resident memory per rank against the sequence length (PNG, needs matplotlib).
* ``--compile``: ``engine.compile()`` (aot_eager, each graph counted) with sequence parallelism 2,
  ZeRO 0 and 3: graphs compiled after each step, graph breaks with their reasons, losses against eager.

    OMP_NUM_THREADS=1 python contrib/bench/bench_sequence.py --bytes
    OMP_NUM_THREADS=1 python contrib/bench/bench_sequence.py --compile
    OMP_NUM_THREADS=1 python contrib/bench/bench_sequence.py --longest --cap-mib 700 --start 1024 --limit 65536 \
        --deepspeed-python .venv-peers/bin/python --plot docs/plugins/sequence_longest.png
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
ALST_MODEL = {"mlp_tiles": 8, "loss_tiles": 16, "checkpoint_blocks": True}
ALST_CONFIG = {"activation_checkpointing": {"cpu_checkpointing": True}}
#: zkit-sparse's sliding window (3 blocks of 64) plus the first block, probabilities recomputed in backward
SLIDING_WINDOW = {"attention": "block_sparse", "attention_kwargs": {
    "mode": "bslongformer", "block": 64, "num_sliding_window_blocks": 3, "global_block_indices": [0],
    "save_probs": False}}
#: name -> (runner, sequence-parallel size, model options, config sections); no commas (--setups splits on them)
SETUPS = {
    "data parallel (4 replicas)": ("zkit", 1, {}, {}),
    "Ulysses 4": ("zkit", 4, {}, {}),
    "Ulysses 4 + tiled MLP and loss + checkpoints to host": ("zkit", 4, ALST_MODEL, ALST_CONFIG),
    "Ulysses 4 + tiled MLP and loss + checkpoints to host + block-sparse attention (sliding window)": (
        "zkit", 4, {**ALST_MODEL, **SLIDING_WINDOW}, ALST_CONFIG),
    "DeepSpeed 0.19.8 Ulysses 4": ("deepspeed", 4, {}, {}),
    "DeepSpeed 0.19.8 Ulysses 4 + TiledMLP and TiledFusedLogitsLoss + checkpointed blocks": (
        "deepspeed", 4, ALST_MODEL, {}),
}


def longest_rank(seq: int, sp: int, model_options: dict, extra: dict, cap: int) -> dict:
    from zero_workloads import RssGuard, peak_rss_bytes, rss_bytes

    import zkit

    guard = RssGuard(cap)
    # built for the sequence it trains (a block-sparse layout is made for max_seq_len)
    model = _model(**{**LONG_MODEL, **model_options, "max_seq_len": seq})
    engine, *_ = zkit.initialize(model=model, config=_config(sp, extra))
    base = rss_bytes()
    start = time.perf_counter()
    _step(engine, seq, LONG_MODEL["vocab_size"], sp)
    took = time.perf_counter() - start
    guard.stop()
    engine.close()
    return {"base": base, "step_s": took, "peak": peak_rss_bytes()}


class OverCap(Exception):
    """A run that did not train its step under the cap (or failed): the first line says why."""


def _run_zkit(seq: int, sp: int, model_options: dict, extra: dict, cap: int) -> list[dict]:
    from zkit.testing import RanksFailed, RanksTimedOut, run_ranks

    try:
        return run_ranks(longest_rank, 4, args=(seq, sp, model_options, extra, cap), timeout=900, start="spawn")
    except (RanksFailed, RanksTimedOut) as exc:
        raise OverCap(str(exc).splitlines()[0]) from exc


def _run_deepspeed(seq: int, model_options: dict, cap: int, python: str) -> list[dict]:
    """DeepSpeed's side (sequence_deepspeed_side.py) in DeepSpeed's interpreter ``python``."""
    import json
    import subprocess
    import tempfile

    from sequence_deepspeed_side import RESULT_PREFIX
    from zero_deepspeed_side import deepspeed_command

    args = ["--seq", str(seq), "--rss-cap", str(cap), "--model", json.dumps(LONG_MODEL)]
    if model_options:
        args += ["--alst", "--mlp-tiles", str(model_options["mlp_tiles"]), "--loss-tiles", str(model_options["loss_tiles"])]
    with tempfile.TemporaryDirectory() as shims:
        cmd, env = deepspeed_command(python, args, shims)
        cmd[1] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sequence_deepspeed_side.py")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    last = [l for l in (proc.stderr + proc.stdout).splitlines() if l.strip()]
    raise OverCap(next((l for l in last if "rss guard" in l), last[-1] if last else f"exit {proc.returncode}"))


def longest_mode(cap_mib: int, start: int, limit: int, setups: list[str], deepspeed_python: str | None,
                 plot: str | None, baseline: int | None = None, plot_with: list[str] = ()) -> list[str]:
    """Each setup from ``start`` tokens (the later ones from the first one's longest, or
    ``baseline``: the data-parallel length measured in another run), doubling. ``plot``: a PNG
    of the peak memory per length, its points also written beside it as JSON; ``plot_with``:
    such JSON files of other runs, drawn too."""
    rows = [f"| setup (4 ranks, cap {cap_mib} MiB resident per rank) | longest sequence | x data parallel | "
            "over the cap | resident after initialize | peak resident at the longest | step at the longest |",
            "|---|---|---|---|---|---|---|"]
    dp, curves = baseline, {}
    for name in setups:
        runner, sp, model_options, extra = SETUPS[name]
        if runner == "deepspeed" and deepspeed_python is None:
            rows.append(f"| {name} | not run: no DeepSpeed interpreter (--deepspeed-python) | | | | | |")
            continue
        best, seq, out, failed, points = 0, start if dp is None else max(start, dp), None, "", []
        while seq <= limit:
            try:
                if runner == "zkit":
                    got = _run_zkit(seq, sp, model_options, extra, cap_mib * MIB)
                else:
                    got = _run_deepspeed(seq, model_options, cap_mib * MIB, deepspeed_python)
            except OverCap as exc:
                print(f"{name}: {seq} tokens: {exc}", flush=True)
                failed = f"{seq:,}"
                break
            best, out = seq, got
            points.append((seq, max(r["peak"] for r in got) / MIB))
            print(f"{name}: {seq} tokens trained ({max(r['step_s'] for r in got):.1f} s; resident after initialize "
                  f"{max(r['base'] for r in got) / MIB:.0f} MiB, peak {points[-1][1]:.0f} MiB)", flush=True)
            seq *= 2
        curves[name] = points
        dp = (best or None) if dp is None else dp
        if out is None:
            rows.append(f"| {name} | under {seq:,} | | {failed} | | | |")
            continue
        reached = f"{best:,}" + ("+" if not failed else "")
        ratio = f"{best / dp:.0f}" + ("+" if not failed else "")
        rows.append(f"| {name} | {reached} | {ratio} | {failed or 'not reached'} | "
                    f"{max(r['base'] for r in out) / MIB:.0f} MiB | {points[-1][1]:.0f} MiB | "
                    f"{max(r['step_s'] for r in out):.1f} s |")
    if plot:
        import json

        for other in plot_with:  # the same setup's points of several runs drawn as one curve
            with open(other, encoding="utf-8") as f:
                for name, points in json.load(f).items():
                    curves[name] = sorted({*map(tuple, curves.get(name, [])), *map(tuple, points)})
        with open(os.path.splitext(plot)[0] + ".json", "w", encoding="utf-8") as f:
            json.dump(curves, f, indent=1)
        _plot(curves, cap_mib, plot)
    return rows


def _plot(curves: dict[str, list[tuple[int, float]]], cap_mib: int, path: str) -> None:
    """Peak resident memory per rank against sequence length (PNG; needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed", flush=True)
        return
    fig, ax = plt.subplots(figsize=(8, 6))
    for name, points in curves.items():
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax.axhline(cap_mib, color="grey", linestyle="--", label=f"cap {cap_mib} MiB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens, whole sequence)")
    ax.set_ylabel("peak resident memory per rank (MiB)")
    ax.set_title("One training step, 4 ranks (bench_sequence.py --longest)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}", flush=True)


# -- compile ------------------------------------------------------------------------------------------
COMPILE_MODEL = dict(vocab_size=256, n_layer=2, d_model=32, n_head=4, n_kv_head=2, ffn=64, max_seq_len=256)


def compile_rank(sp: int, stage: int, steps: int, seq: int) -> dict:
    """``steps`` steps eager, then the same under ``engine.compile`` (aot_eager, each graph Dynamo
    hands the backend counted): losses, graphs compiled after each step, graph breaks and their reasons."""
    import torch
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.utils import counters

    import zkit
    from zkit_sequence import sequence_communicator, shard, with_positions

    out: dict = {}
    for how in ("eager", "engine.compile"):
        torch._dynamo.reset()
        counters.clear()
        graphs = [0]

        def counting(gm, inputs):
            graphs[0] += 1
            return lookup_backend("aot_eager")(gm, inputs)

        engine, *_ = zkit.initialize(model=_model(**COMPILE_MODEL),
                                     config={**_config(sp), "zero_optimization": {"stage": stage}})
        if how == "engine.compile":
            engine.compile(backend=counting)
        losses, per_step = [], []
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, COMPILE_MODEL["vocab_size"], (1, seq), generator=g)
            comm = sequence_communicator(engine)
            ids_, labels, positions = shard(with_positions((ids, ids.roll(-1, dims=1))), comm.rank, comm.world_size)
            loss = engine(ids_, labels, positions)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            per_step.append(graphs[0])
        out[how] = {"losses": losses, "graphs": per_step, "breaks": dict(counters["graph_break"]),
                    "recompiles": sum(v for k, v in counters["stats"].items() if "recompil" in k)}
        engine.close()
    return out


def compile_mode(steps: int = 4, seq: int = 64) -> list[str]:
    from zkit.testing import run_ranks

    rows = ["| layout | ZeRO stage | graphs compiled after step 1, 2, ... | graph breaks | largest loss difference "
            "against eager |", "|---|---|---|---|---|"]
    for sp, stage in ((2, 0), (2, 3)):
        out = run_ranks(compile_rank, sp, args=(sp, stage, steps, seq), timeout=900)[0]
        eager, compiled = out["eager"], out["engine.compile"]
        diff = max(abs(a - b) for a, b in zip(eager["losses"], compiled["losses"]))
        breaks = sum(compiled["breaks"].values())
        reasons = "; ".join(f"{k} ({v})" for k, v in compiled["breaks"].items())
        rows.append(f"| SP {sp} on {sp} ranks | {stage} | {', '.join(map(str, compiled['graphs']))} | {breaks}"
                    f"{': ' + reasons if reasons else ''} | {diff:.1e} |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", action="store_true", help="all-to-all bytes against the formula")
    p.add_argument("--longest", action="store_true", help="longest sequence under the memory cap")
    p.add_argument("--compile", action="store_true", help="graphs and graph breaks of engine.compile() with SP")
    p.add_argument("--seq", type=int, default=1024, help="tokens of the --bytes step")
    p.add_argument("--cap-mib", type=int, default=700, help="resident memory cap per rank (--longest)")
    p.add_argument("--start", type=int, default=2048, help="first sequence length tried")
    p.add_argument("--limit", type=int, default=1 << 15, help="longest sequence length tried")
    p.add_argument("--setups", default=",".join(SETUPS),
                   help="comma-separated setup names (--longest; none: only --plot the points of --plot-with)")
    p.add_argument("--deepspeed-python", default=None,
                   help="DeepSpeed's interpreter for the DeepSpeed setups (e.g. .venv-peers/bin/python)")
    p.add_argument("--plot", default=None, help="write the peak memory against sequence length there (PNG)")
    p.add_argument("--plot-with", default="", help="comma-separated JSON points of other --plot runs to draw too")
    p.add_argument("--baseline", type=int, default=None,
                   help="the data-parallel length of another run (when its setup is not in --setups)")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.bytes:
        print("\n".join(bytes_mode(args.seq)))
    if args.compile:
        print("\n".join(compile_mode()))
    if args.longest:
        print("\n".join(longest_mode(args.cap_mib, args.start, args.limit, [n for n in args.setups.split(",") if n],
                                     args.deepspeed_python, args.plot, args.baseline,
                                     [f for f in args.plot_with.split(",") if f])))


if __name__ == "__main__":
    main()
