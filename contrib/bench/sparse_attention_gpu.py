"""The GPU table of block-sparse attention: ``bench_sparse_attention.py --gpu`` (and ``--cpu-smoke``).

One process, cases in order of importance, each guarded (a failure, out of memory included, is a
row, not an abort) and the whole run bounded by ``--budget-s`` (a case that would start past it
is listed as skipped). Timings: forward + backward of ``[1, heads, T, 64]`` q, k, v; the first
call (compile included) is reported apart as ``first_s``, then two warm-up calls, then the median
of up to ``reps`` calls timed with CUDA events after ``torch.cuda.synchronize()``.

Stages:
  kernels  bf16, 16 heads x 64, the layouts of :data:`FAMILIES` (Fixed with 4 and with 16
           local blocks, unidirectional; BigBird and BSLongformer with a constant window, global
           and random blocks, so their density falls as the sequence grows) at layout blocks 64
           and 128, at 4096, 16384, 32768, 65536 and 131072 tokens: causal and bidirectional
           flash SDPA, zkit's flex backend, a hand-written FlexAttention call with the same mask
           (``create_block_mask(..., _compile=True)``, BLOCK_SIZE 128), zkit's flex backend again
           (a new module, after the hand-written call, to expose effects of the order); at 4096
           and 16384 for the first table's Fixed and BigBird also the flex backend with a
           128 x 64 tile, the numba and torch backends. The table gives each row's time over
           dense SDPA of its layout's direction and the flex rows' time over the hand-written
           call's, then per layout where block-sparse overtakes dense.
  fp32     the three zkit backends in fp32 at 4096 against the float64 reference (1e-5 target).
  gpt      a 12-layer GPT (d 768, 12 heads, vocab 8192) at 16384 to 131072 tokens, dense flash
           SDPA against block-sparse (Fixed at block 64, BSLongformer at block 128; flex backend
           through ``auto``), activation checkpointing on every block, bf16 autocast, AdamW. A
           variant that runs out of memory, past the step-time cap or the budget stops; its
           longer lengths are rows saying so.

Correctness: outputs and q/k/v gradients against dense attention with the layout materialised
(float64 up to 4096 tokens, fp32 memory-efficient SDPA up to 16384; beyond, the ``T x T`` mask
does not fit and the error is not checked), max abs; bf16 target 2e-2.
On the CPU (``--cpu-smoke``) shapes are tiny (layout blocks 16 and 32, tile 32, 128 to 512
tokens), FlexAttention runs eagerly and forward-only (it has no CPU backward), and times are
wall-clock medians: it checks the script, not the speed. ``geometry()`` (``--geometry``) gives
the layouts' density and tiles at the GPU lengths, computed on the CPU.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# Layouts of the table: family -> (causal, {layout block: constructor keywords}). Block-128
# entries hold the 64-token entries' token pattern where the layout allows it; window, global and
# random blocks are constant, so the density falls as the sequence grows, except Fixed's
# (one global block per window of num_local_blocks: ~13 % at every length with 4 local blocks,
# ~3 % with a 1024-token window).
FAMILIES: dict[str, tuple[bool, dict[int, dict]]] = {
    "fixed": (True, {64: dict(num_local_blocks=4, num_global_blocks=1),
                     128: dict(num_local_blocks=2, num_global_blocks=1)}),
    "fixed-w1024": (True, {64: dict(num_local_blocks=16, num_global_blocks=1),
                           128: dict(num_local_blocks=8, num_global_blocks=1)}),
    "bigbird": (False, {64: dict(num_sliding_window_blocks=7, num_random_blocks=4, num_global_blocks=2),
                        128: dict(num_sliding_window_blocks=3, num_random_blocks=2, num_global_blocks=1)}),
    "bslongformer": (False, {64: dict(num_sliding_window_blocks=7, global_block_indices=[0, 1]),
                             128: dict(num_sliding_window_blocks=3, global_block_indices=[0])}),
    # the first H100 table's BigBird (~13 % of the blocks at 16384 tokens)
    "bigbird-wide": (False, {64: dict(num_sliding_window_blocks=17, num_random_blocks=14,
                                      num_global_blocks=2)}),
}
#: families timed with every backend at the short lengths, as in the first H100 table
ALL_BACKENDS = ("fixed", "bigbird-wide")
#: longest sequence whose error is checked against dense attention with the layout materialised
REFERENCE_MAX = 16384
SMOKE_KWARGS = {"fixed-w1024": {16: dict(num_local_blocks=8, num_global_blocks=1),
                                32: dict(num_local_blocks=4, num_global_blocks=1)},
                "bigbird-wide": {16: dict(num_sliding_window_blocks=5, num_random_blocks=2,
                                          num_global_blocks=1)}}


class Run:
    """Shape set, device, deadline and the rows written so far (JSON lines as they come)."""

    def __init__(self, out_dir: Path, smoke: bool, budget_s: float, reps: int):
        self.smoke, self.reps = smoke, reps
        self.device = torch.device("cpu" if smoke else "cuda")
        self.heads, self.dim = (2, 16) if smoke else (16, 64)
        # real sizes -> smoke sizes: layout blocks 64/128 -> 16/32, FlexAttention tile 128 -> 32
        self.blocks = {64: 16, 128: 32} if smoke else {64: 64, 128: 128}
        self.short = (128, 256) if smoke else (4096, 16384)
        self.long = (512,) if smoke else (32768, 65536, 131072)
        self.flex_tile = 32 if smoke else 128
        self.deadline = time.monotonic() + budget_s
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(out_dir / "rows.jsonl", "w")
        self.rows: list[dict] = []

    @property
    def seqs(self) -> tuple[int, ...]:
        return self.short + self.long

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        print(json.dumps(row), flush=True)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def sparsity_config(run: Run, family: str, block: int = 64, heads: int | None = None):
    """The layout ``family`` at the real layout block ``block`` (64 or 128), scaled for smoke runs."""
    from zkit_sparse import BigBirdSparsityConfig, BSLongformerSparsityConfig, FixedSparsityConfig

    causal, per_block = FAMILIES[family]
    real = run.blocks[block]
    kwargs = SMOKE_KWARGS.get(family, {}).get(real, per_block[block]) if run.smoke else per_block[block]
    heads = heads or run.heads
    if family.startswith("fixed"):
        return FixedSparsityConfig(heads, block=real, attention="unidirectional", **kwargs)
    if family.startswith("bigbird"):
        return BigBirdSparsityConfig(heads, block=real, **kwargs)
    return BSLongformerSparsityConfig(heads, block=real, **kwargs)


def cases(run: Run) -> list[tuple[str, int, int]]:
    """(family, layout block, seq) in the order they run, most wanted first: the case where the
    flex backend was 12x the hand-written call, the 65536-token cases block-sparse must win, the
    rest of the first table, then every family at every length, block 128 before block 64."""
    first = [("fixed", 64, run.short[0])]
    target = [(f, 128, run.long[min(1, len(run.long) - 1)]) for f in ("bigbird", "bslongformer")]
    table1 = [(f, 64, s) for f in ALL_BACKENDS for s in run.short]
    rest = [(f, b, s) for s in run.seqs for b in (128, 64) for f in FAMILIES if b in FAMILIES[f][1]]
    out: list[tuple[str, int, int]] = []
    for case in first + target + table1 + rest:
        if case not in out:
            out.append(case)
    return out


def tile_fractions(layout: torch.Tensor, block: int, seq: int, causal: bool, tile: int) -> dict:
    """Partial and full FlexAttention tiles of the layout's BlockMask, as fractions of all tiles."""
    from zkit_sparse.flex_block_mask import layout_block_mask

    bm = layout_block_mask(layout, block, seq, causal, "cpu", tile)
    total = bm.kv_num_blocks.shape[-1] * bm.kv_indices.shape[-1] * bm.kv_num_blocks.shape[1]
    return {"partial": round(int(bm.kv_num_blocks.sum()) / total, 4),
            "full": round(int(bm.full_kv_num_blocks.sum()) / total, 4)}


def time_call(run: Run, fn, backward: bool | None, warmup: int = 2, min_reps: int = 3,
              seconds: float = 5.0) -> tuple[float, float, int]:
    """(first call s, median s, reps) of ``fn()``, followed by a backward of its output with
    ones when ``backward``; under ``torch.no_grad()`` when ``backward is False``."""
    def once():
        if backward is False:
            with torch.no_grad():
                return fn()
        out = fn()
        if backward:
            out.backward(torch.ones_like(out))
        return out

    t0 = time.perf_counter()
    once()
    run.sync()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(warmup):
        once()
    run.sync()
    per_call = (time.perf_counter() - t0) / warmup if warmup else first  # compile excluded
    reps = max(min_reps, min(run.reps, int(seconds / max(per_call, 1e-4))))  # slow ones: fewer reps
    times = []
    for _ in range(reps):
        if run.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            once()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
    return first, statistics.median(times), reps


def dense_mask(layout: torch.Tensor, block: int, causal: bool) -> torch.Tensor:
    mask = layout[0].bool().repeat_interleave(block, 0).repeat_interleave(block, 1)
    return mask.tril_() if causal else mask


def reference(q, k, v, mask, dout):
    """Output and q/k/v gradients of dense attention with ``mask``: float64 written out when it
    fits (T <= 4096), else fp32 memory-efficient SDPA."""
    exact = q.shape[2] <= 4096
    dtype = torch.float64 if exact else torch.float32
    x = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    if exact:
        s = (x[0] @ x[1].transpose(-1, -2)) / math.sqrt(q.shape[-1])
        out = s.masked_fill(~mask, float("-inf")).softmax(-1) @ x[2]
    else:
        out = F.scaled_dot_product_attention(*x, attn_mask=mask)
    grads = torch.autograd.grad(out, x, dout.to(dtype))
    return out.detach(), grads


def errors(fn, q, k, v, ref, backward: bool) -> dict:
    """Max abs difference of output (and gradients) against ``ref`` = (dout, out, grads)."""
    q, k, v = (t.detach().requires_grad_(backward) for t in (q, k, v))
    dout, want, want_grads = ref
    with torch.enable_grad() if backward else torch.no_grad():
        out = fn(q, k, v)
    err = {"out": (out.double() - want.double()).abs().max().item()}
    if backward:
        grads = torch.autograd.grad(out, (q, k, v), dout)
        for name, a, b in zip(("dq", "dk", "dv"), grads, want_grads):
            err[name] = (a.double() - b.double()).abs().max().item()
    return err


def variants(run: Run, family: str, block: int, seq: int, dtype: torch.dtype):
    """name -> (builder of the attention callable (q, k, v) -> out, trains on this device)."""
    from zkit_sparse import SparseSelfAttention
    from zkit_sparse.backends import numba_unavailable_reason

    cfg = sparsity_config(run, family, block)
    causal = FAMILIES[family][0]
    on_gpu = run.device.type == "cuda"
    out = {name: (lambda c=c: lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=c), True)
           for name, c in (("dense-causal", True), ("dense-bidir", False))}

    def module(**kw):
        def build():
            attn = SparseSelfAttention(cfg, max_seq_length=seq, causal=causal, **kw)
            return lambda q, k, v: attn(q, k, v)
        return build

    out["flex"] = (module(backend="flex", flex_block_size=run.flex_tile), on_gpu)
    out["flex-hand"] = (lambda: hand_written_flex(run, cfg, seq, causal), on_gpu)
    # zkit's call again, timed after the hand-written one, from a new module: it runs the graph
    # "flex" compiled, so a gap between "flex" and "flex-again" comes from the order of the rows
    out["flex-again"] = (module(backend="flex", flex_block_size=run.flex_tile), on_gpu)
    if family in ALL_BACKENDS and seq in run.short:
        if dtype != torch.float32 and on_gpu:
            out["flex-128x64"] = (module(backend="flex", flex_block_size=(128, 64), flex_kernel_options=dict(
                BLOCK_M=128, BLOCK_N=64, BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64)), True)
        if on_gpu and numba_unavailable_reason(cfg.block) is None:
            out["numba"] = (module(backend="numba"), True)
        out["torch"] = (module(backend="torch"), True)
    return out


def hand_written_flex(run: Run, cfg, seq: int, causal: bool):
    """FlexAttention as a user would call it: a mask_mod over the layout, create_block_mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    layout = cfg.make_layout(seq)[0].bool().to(run.device)
    blk = cfg.block

    def mask_mod(b, h, q_idx, kv_idx):
        keep = layout[q_idx // blk, kv_idx // blk]
        return keep & (q_idx >= kv_idx) if causal else keep

    on_gpu = run.device.type == "cuda"
    bm = create_block_mask(mask_mod, 1, 1, seq, seq, device=run.device, BLOCK_SIZE=run.flex_tile,
                           _compile=on_gpu)
    call = torch.compile(flex_attention, dynamic=False) if on_gpu else flex_attention
    return lambda q, k, v: call(q, k, v, block_mask=bm)


def kernel_stage(run: Run, dtype: torch.dtype, todo, names=None) -> None:
    """Rows of every (family, block, seq) in ``todo``; errors against dense attention with the
    layout materialised up to :data:`REFERENCE_MAX` tokens (beyond, its ``T x T`` mask does not fit)."""
    tag = str(dtype).replace("torch.", "")
    for family, block, seq in todo:
        causal = FAMILIES[family][0]
        cfg = sparsity_config(run, family, block, heads=1)  # every head has head 0's layout
        blocks = cfg.make_layout(seq)
        base = dict(stage="kernels" if dtype != torch.float32 else "fp32", layout=family,
                    block=block, seq=seq, dtype=tag, causal=causal,
                    density=round(blocks[0].float().mean().item(), 4),
                    tiles=tile_fractions(blocks, cfg.block, seq, causal, run.flex_tile))
        wanted = {n: v for n, v in variants(run, family, block, seq, dtype).items()
                  if names is None or n in names}
        if run.left() <= 0:
            for name in wanted:
                run.add(dict(base, variant=name, skipped="time budget"))
            continue
        gen = torch.Generator(device=run.device).manual_seed(0)
        q, k, v = (torch.randn(1, run.heads, seq, run.dim, generator=gen, device=run.device,
                               dtype=dtype).requires_grad_() for _ in range(3))
        gen = torch.Generator(device=run.device).manual_seed(1)
        dout = torch.randn(q.shape, generator=gen, device=run.device, dtype=dtype)
        checked = seq <= (REFERENCE_MAX if not run.smoke else run.seqs[-1])
        ref = None  # (dout, output, gradients) of the dense masked reference, made once
        for name, (build, trains) in wanted.items():
            row = dict(base, variant=name, backward=trains)
            args = (q, k, v) if trains else tuple(x.detach() for x in (q, k, v))
            if run.left() <= 0:
                run.add(dict(row, skipped="time budget"))
                continue
            try:  # a failure is a row, not an abort
                fn = build()
                if dtype != torch.float32:
                    row["first_s"], row["median_s"], row["reps"] = time_call(
                        run, lambda: fn(*args), trains)
                if not name.startswith("dense") and checked:
                    if ref is None:
                        mask = dense_mask(blocks, cfg.block, causal).to(run.device)
                        ref = (dout, *reference(q, k, v, mask, dout))
                        del mask
                    row["max_abs"] = errors(fn, q, k, v, ref, trains)
            except torch.OutOfMemoryError:
                row["error"] = "out of memory"
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            finally:
                q.grad = k.grad = v.grad = None
            run.add(row)
            if run.device.type == "cuda":
                torch.cuda.empty_cache()
        del q, k, v, dout, ref


def query_probe(run: Run, heads: int, seq: int) -> torch.Tensor:
    """A tensor of the GPT's attention queries' shape (head_dim 0), device and dtype, to ask the
    attention for its backend."""
    return torch.empty(1, heads, seq, 0, device=run.device,
                       dtype=torch.float32 if run.smoke else torch.bfloat16)


def gpt_stage(run: Run, step_cap_s: float) -> None:
    import zkit.activations.recompute as ckpt
    from zkit.models.gpt import GPT, GPTConfig

    layers, d, heads, vocab = (2, 64, 4, 256) if run.smoke else (12, 768, 12, 8192)
    seqs = [128, 256] if run.smoke else [16384, 32768, 65536, 131072]
    # variant -> layout (family, block) or None for dense flash SDPA
    layouts = {"dense": None, "fixed-64": ("fixed", 64), "bslongformer-128": ("bslongformer", 128)}
    last_step = dict.fromkeys(layouts, 0.0)
    stopped: dict[str, str] = {}  # variant -> why its longer lengths do not run
    for seq in seqs:
        for variant, layout in layouts.items():
            attention = "dense" if layout is None else "block_sparse"
            row = dict(stage="gpt", variant=variant, seq=seq, layers=layers, d_model=d)
            if variant in stopped:
                run.add(dict(row, skipped=stopped[variant]))
                continue
            # three steps at up to 4x the last step's time (attention is quadratic in the length)
            if run.left() <= 3 * 4 * last_step[variant]:
                run.add(dict(row, skipped="time budget"))
                stopped[variant] = "time budget"
                continue
            kwargs = {} if layout is None else dict(
                sparsity_config=sparsity_config(run, *layout, heads=heads))
            model = opt = None
            try:
                cfg = GPTConfig(vocab_size=vocab, seq_len=seq, n_layer=layers, n_head=heads,
                                d_model=d, attention=attention, attention_kwargs=kwargs)
                model = GPT(cfg).to(run.device)
                ckpt.apply(model, "every")
                core = model.blocks[0].attn.core
                if hasattr(core, "backend_for"):
                    row["backend"] = core.backend_for(query_probe(run, heads, seq))
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=run.device.type == "cuda")
                ids = torch.randint(0, vocab, (1, seq), device=run.device)
                if run.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()

                def step():
                    with torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=not run.smoke):
                        loss = model(ids, ids)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    return loss

                row["first_s"], row["median_s"], row["reps"] = time_call(
                    run, step, backward=None, warmup=0, min_reps=2, seconds=10.0)
                if run.device.type == "cuda":
                    row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            except torch.OutOfMemoryError:
                row["error"] = "out of memory"
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            del model, opt
            if run.device.type == "cuda":
                torch.cuda.empty_cache()
            if "error" not in row and row["median_s"] > step_cap_s:
                row["note"] = f"step past the {step_cap_s:g} s cap: longer lengths not run"
            run.add(row)
            if "error" in row:
                stopped[variant] = f"not run after {row['error']} at {seq}"
            elif row["median_s"] > step_cap_s:
                stopped[variant] = f"not run: the step took {row['median_s']:.1f} s at {seq}"
            else:
                last_step[variant] = row["median_s"]


def _ms(t) -> str:
    return f"{t * 1e3:.2f} ms" if t else "-"


def table(run: Run) -> str:
    """Markdown: kernel rows (time, against dense SDPA of the layout's direction and against the
    hand-written FlexAttention call, error), where block-sparse overtakes dense, the GPT lengths."""
    lines = ["| stage | layout | block | seq | dtype | density | tiles partial / full | variant | fwd+bwd "
             "| x dense SDPA | x flex-hand | first call | max abs (out, dq, dk, dv) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    timed = {(r["stage"], r["layout"], r["block"], r["seq"], r["variant"]): r.get("median_s")
             for r in run.rows if r["stage"] in ("kernels", "fp32")}
    for r in (r for r in run.rows if r["stage"] in ("kernels", "fp32")):
        key = (r["stage"], r["layout"], r["block"], r["seq"])
        dense = timed.get((*key, "dense-causal" if r["causal"] else "dense-bidir"))
        hand = timed.get((*key, "flex-hand"))
        t = r.get("median_s")
        trains = r.get("backward", True)
        vs_dense = f"{t / dense:.2f}" if dense and t and trains else "-"
        vs_hand = f"{t / hand:.2f}" if hand and t and r["variant"].startswith("flex") else "-"
        err = ", ".join(f"{x:.1e}" for x in r.get("max_abs", {}).values()) or "-"
        cell = _ms(t) if t else (r.get("error") or r.get("skipped") or "-")
        if not trains:
            cell += " (fwd only)"
        first = f"{r['first_s']:.1f} s" if "first_s" in r else "-"
        tiles = f"{r['tiles']['partial']:.3f} / {r['tiles']['full']:.3f}"
        lines.append(f"| {r['stage']} | {r['layout']} | {r['block']} | {r['seq']} | {r['dtype']} | "
                     f"{r['density']} | {tiles} | {r['variant']} | {cell} | {vs_dense} | {vs_hand} | "
                     f"{first} | {err} |")
    lines += ["", crossover(run), "",
              "| GPT attention | seq | step | peak memory | note |", "|---|---|---|---|---|"]
    for r in (r for r in run.rows if r["stage"] == "gpt"):
        step = f"{r['median_s']:.2f} s" if "median_s" in r else "-"
        peak = f"{r['peak_gib']} GiB" if "peak_gib" in r else "-"
        note = r.get("error") or r.get("skipped") or r.get("note") or ""
        lines.append(f"| {r['variant']} | {r['seq']} | {step} | {peak} | {note} |")
    return "\n".join(lines) + "\n"


def crossover(run: Run) -> str:
    """Per layout and block: the flex backend's time over dense SDPA's at each length, and the
    shortest length where block-sparse was faster."""
    rows: dict[tuple[str, int], dict[int, float]] = {}
    timed = {(r["layout"], r["block"], r["seq"], r["variant"]): r.get("median_s")
             for r in run.rows if r["stage"] == "kernels" and r.get("backward", True)}
    causal = {(r["layout"], r["block"]): r["causal"] for r in run.rows if r["stage"] == "kernels"}
    for (layout, block, seq, variant), t in timed.items():
        dense = timed.get((layout, block, seq, "dense-causal" if causal[layout, block] else "dense-bidir"))
        if variant == "flex" and t and dense:
            rows.setdefault((layout, block), {})[seq] = t / dense
    seqs = sorted({s for r in rows.values() for s in r})
    lines = ["| layout | block | " + " | ".join(f"flex / dense at {s}" for s in seqs) + " | block-sparse faster from |",
             "|---|---|" + "---|" * len(seqs) + "---|"]
    for (layout, block), ratio in rows.items():
        wins = [s for s in seqs if ratio.get(s, 2.0) < 1.0]
        lines.append(f"| {layout} | {block} | " + " | ".join(
            f"{ratio[s]:.2f}" if s in ratio else "-" for s in seqs) +
            f" | {wins[0] if wins else 'not within the lengths measured'} |")
    return "\n".join(lines)


def geometry(families=None, block_sizes=(64, 128)) -> str:
    """Density and FlexAttention tiles of the table's layouts at the GPU lengths, computed on the
    CPU (no timing): the work block-sparse does, as a fraction of dense attention's."""
    run = Run.__new__(Run)
    run.smoke, run.blocks, run.flex_tile, run.heads = False, {64: 64, 128: 128}, 128, 1
    lines = ["| layout | block | seq | density | of the causal triangle | tiles partial / full |",
             "|---|---|---|---|---|---|"]
    for family in families or FAMILIES:
        causal, per_block = FAMILIES[family]
        for block in (b for b in block_sizes if b in per_block):
            for seq in (4096, 16384, 32768, 65536, 131072):
                layout = sparsity_config(run, family, block).make_layout(seq)
                nb = seq // block
                density = layout[0].float().mean().item()
                tri = layout[0].tril().float().sum().item() / (nb * (nb + 1) / 2) if causal else None
                t = tile_fractions(layout, block, seq, causal, 128)
                lines.append(f"| {family} | {block} | {seq} | {density:.4f} | "
                             f"{'-' if tri is None else f'{tri:.4f}'} | {t['partial']:.4f} / {t['full']:.4f} |")
    return "\n".join(lines) + "\n"


def main(out_dir: str, smoke: bool, budget_s: float, reps: int, stages, step_cap_s: float,
         families=None, seqs=None, kernel_share: float = 0.7) -> Path:
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device (use --cpu-smoke to check the script here)")
    unknown = sorted(set(families or ()) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"unknown layouts {unknown}; the table's are {sorted(FAMILIES)}")
    # Every length, layout block and dtype compiles flex_attention once (twice with the
    # hand-written call); past torch's default limit of 8 per function FlexAttention would run
    # eagerly (scores materialised).
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 512)
    run = Run(Path(out_dir), smoke, budget_s, reps)
    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if not smoke else "cpu")
    print(json.dumps(env), flush=True)
    todo = [c for c in cases(run) if (families is None or c[0] in families) and (seqs is None or c[2] in seqs)]
    if "kernels" in stages:
        # the kernels leave the GPT stage its share of the budget
        end = run.deadline
        run.deadline = time.monotonic() + kernel_share * budget_s if "gpt" in stages else end
        kernel_stage(run, torch.bfloat16, todo)
        run.deadline = end
    if "fp32" in stages:
        kernel_stage(run, torch.float32, [c for c in todo if c[0] in ALL_BACKENDS and c[2] == run.short[0]],
                     names=("flex", "numba", "torch"))
    if "gpt" in stages:
        gpt_stage(run, step_cap_s)
    text = f"{json.dumps(env)}\n\n" + table(run)
    path = run.out_dir / "table.md"
    path.write_text(text)
    print(text)
    return path
