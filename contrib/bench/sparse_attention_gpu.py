"""The GPU table of block-sparse attention: ``bench_sparse_attention.py --gpu`` (and ``--cpu-smoke``).

One process, stages in order of importance, each case guarded (a failure is a row, not an abort)
and the whole run bounded by ``--budget-s`` (a case that would start past it is listed as
skipped). Timings: forward + backward of ``[1, heads, T, 64]`` q, k, v; warm-up first (the first
call, compile included, is reported as ``first_s``), then the median of up to ``reps`` calls timed
with CUDA events after ``torch.cuda.synchronize()``.

Stages:
  kernels  bf16, Fixed (4 local blocks, 1 global, unidirectional; dense = causal flash SDPA) and
           BigBird (~13 % of the blocks at 16384; dense = bidirectional flash SDPA) at 4096 and
           16384 tokens: dense SDPA, zkit's flex backend, a hand-written FlexAttention call with
           the same mask (``create_block_mask(..., _compile=True)``, BLOCK_SIZE 128), zkit's flex
           backend again (after the hand-written call, to expose effects of the order), zkit's
           flex backend with a 128 x 64 tile, the numba and torch backends.
  fp32     the three zkit backends in fp32 at 4096 against the float64 reference (1e-5 target).
  gpt      the longest sequence a 12-layer GPT (d 768, 12 heads, vocab 8192) trains on, dense
           against block-sparse (Fixed, flex backend), activation checkpointing on every block,
           bf16 autocast, AdamW; lengths double until out of memory, the step-time cap or the
           budget.

Correctness: outputs and q/k/v gradients against dense attention with the layout materialised
(float64 up to 4096 tokens, fp32 memory-efficient SDPA beyond), max abs; bf16 target 2e-2.
On the CPU (``--cpu-smoke``) shapes are tiny, FlexAttention runs eagerly and forward-only (it has
no CPU backward), and times are wall-clock medians: it checks the script, not the speed.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

FIXED = dict(num_local_blocks=4, num_global_blocks=1, attention="unidirectional")
BIGBIRD = dict(num_sliding_window_blocks=17, num_random_blocks=14, num_global_blocks=2)


class Run:
    """Shape set, device, deadline and the rows written so far (JSON lines as they come)."""

    def __init__(self, out_dir: Path, smoke: bool, budget_s: float, reps: int):
        self.smoke, self.reps = smoke, reps
        self.device = torch.device("cpu" if smoke else "cuda")
        self.heads, self.dim, self.block = (2, 16, 16) if smoke else (16, 64, 64)
        self.seqs = (128,) if smoke else (4096, 16384)
        self.flex_tile = 32 if smoke else 128
        self.deadline = time.monotonic() + budget_s
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(out_dir / "rows.jsonl", "w")
        self.rows: list[dict] = []

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


def sparsity_config(run: Run, layout: str, heads: int | None = None):
    from zkit_sparse import BigBirdSparsityConfig, FixedSparsityConfig

    heads = heads or run.heads
    if layout == "fixed":
        return FixedSparsityConfig(heads, block=run.block, **FIXED)
    if run.smoke:
        return BigBirdSparsityConfig(heads, block=run.block, num_sliding_window_blocks=3,
                                     num_random_blocks=2, num_global_blocks=1)
    return BigBirdSparsityConfig(heads, block=run.block, **BIGBIRD)


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


def variants(run: Run, layout: str, seq: int, dtype: torch.dtype):
    """name -> (builder of the attention callable (q, k, v) -> out, trains on this device)."""
    from zkit_sparse import SparseSelfAttention
    from zkit_sparse.backends import numba_unavailable_reason

    cfg = sparsity_config(run, layout)
    causal = layout == "fixed"
    on_gpu = run.device.type == "cuda"
    out = {"dense": (lambda: lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), True)}

    def module(**kw):
        def build():
            attn = SparseSelfAttention(cfg, max_seq_length=seq, causal=causal, **kw)
            return lambda q, k, v: attn(q, k, v)
        return build

    out["flex"] = (module(backend="flex", flex_block_size=run.flex_tile), on_gpu)
    out["flex-hand"] = (lambda: hand_written_flex(run, cfg, seq, causal), on_gpu)
    # zkit's call again, timed after the hand-written one: both compile the same graph, so a gap
    # between "flex" and "flex-again" comes from the order of the rows, not from the call.
    out["flex-again"] = (module(backend="flex", flex_block_size=run.flex_tile), on_gpu)
    if dtype != torch.float32 and on_gpu:
        out["flex-128x64"] = (module(backend="flex", flex_block_size=(128, 64), flex_kernel_options=dict(
            BLOCK_M=128, BLOCK_N=64, BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64)), True)
    if on_gpu and numba_unavailable_reason(run.block) is None:
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


def kernel_stage(run: Run, dtype: torch.dtype, seqs, layouts, names=None) -> None:
    tag = str(dtype).replace("torch.", "")
    for layout in layouts:
        for seq in seqs:
            gen = torch.Generator(device=run.device).manual_seed(0)
            q, k, v = (torch.randn(1, run.heads, seq, run.dim, generator=gen, device=run.device,
                                   dtype=dtype).requires_grad_() for _ in range(3))
            blocks = sparsity_config(run, layout).make_layout(seq)
            mask = dense_mask(blocks, run.block, layout == "fixed").to(run.device)
            gen = torch.Generator(device=run.device).manual_seed(1)
            dout = torch.randn(q.shape, generator=gen, device=run.device, dtype=dtype)
            ref = None  # (dout, output, gradients) of the dense masked reference, made once
            base = dict(stage="kernels" if dtype != torch.float32 else "fp32", layout=layout,
                        seq=seq, dtype=tag, density=round(blocks[0].float().mean().item(), 4))
            for name, (build, trains) in variants(run, layout, seq, dtype).items():
                if names is not None and name not in names:
                    continue
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
                    if name != "dense":
                        ref = ref or (dout, *reference(q, k, v, mask, dout))
                        row["max_abs"] = errors(fn, q, k, v, ref, trains)
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                finally:
                    q.grad = k.grad = v.grad = None
                run.add(row)
                if run.device.type == "cuda":
                    torch.cuda.empty_cache()


def query_probe(run: Run, heads: int, seq: int) -> torch.Tensor:
    """A tensor of the GPT's attention queries' shape (head_dim 0), device and dtype, to ask the
    attention for its backend."""
    return torch.empty(1, heads, seq, 0, device=run.device,
                       dtype=torch.float32 if run.smoke else torch.bfloat16)


def gpt_stage(run: Run, step_cap_s: float) -> None:
    import zkit.activations.checkpointing as ckpt
    from zkit.models.gpt import GPT, GPTConfig

    layers, d, heads, vocab = (2, 64, 4, 256) if run.smoke else (12, 768, 12, 8192)
    seqs = [128, 256] if run.smoke else [16384, 32768, 65536, 131072, 262144, 524288]
    last_step = {"dense": 0.0, "block_sparse": 0.0}  # a variant leaves once it stops
    for seq in seqs:
        for attention in list(last_step):
            row = dict(stage="gpt", variant=attention, seq=seq, layers=layers, d_model=d)
            # three steps at up to 4x the last step's time (attention is quadratic in the length)
            if run.left() <= 3 * 4 * last_step[attention]:
                run.add(dict(row, skipped="time budget"))
                del last_step[attention]
                continue
            kwargs = {} if attention == "dense" else dict(
                sparsity_config=sparsity_config(run, "fixed", heads))
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
            run.add(row)
            if "error" in row or row["median_s"] > step_cap_s:
                del last_step[attention]
            else:
                last_step[attention] = row["median_s"]


def table(run: Run) -> str:
    """Markdown: kernels (time, speed-up against dense, error), then the GPT lengths."""
    lines = ["| stage | layout | seq | dtype | density | variant | fwd+bwd | vs dense | first call | max abs (out, dq, dk, dv) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    dense = {(r["layout"], r["seq"], r["dtype"]): r.get("median_s") for r in run.rows
             if r["stage"] == "kernels" and r["variant"] == "dense"}
    for r in (r for r in run.rows if r["stage"] in ("kernels", "fp32")):
        d = dense.get((r["layout"], r["seq"], r["dtype"]))
        t = r.get("median_s")
        speed = f"{d / t:.2f}x" if d and t and r.get("backward", True) else "-"
        err = ", ".join(f"{x:.1e}" for x in r.get("max_abs", {}).values()) or "-"
        what = r.get("error") or r.get("skipped")
        cell = f"{t * 1e3:.2f} ms" if t else (what or "-")
        if not r.get("backward", True):
            cell += " (fwd only)"
        first = f"{r['first_s']:.1f} s" if "first_s" in r else "-"
        lines.append(f"| {r['stage']} | {r['layout']} | {r['seq']} | {r['dtype']} | {r['density']} | "
                     f"{r['variant']} | {cell} | {speed} | {first} | {err} |")
    lines += ["", "| GPT attention | seq | step | peak memory | note |", "|---|---|---|---|---|"]
    for r in (r for r in run.rows if r["stage"] == "gpt"):
        step = f"{r['median_s']:.2f} s" if "median_s" in r else "-"
        peak = f"{r['peak_gib']} GiB" if "peak_gib" in r else "-"
        lines.append(f"| {r['variant']} | {r['seq']} | {step} | {peak} | {r.get('error') or r.get('skipped') or ''} |")
    return "\n".join(lines) + "\n"


def main(out_dir: str, smoke: bool, budget_s: float, reps: int, stages, step_cap_s: float,
         layouts=("fixed", "bigbird")) -> Path:
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device (use --cpu-smoke to check the script here)")
    # Every length and dtype compiles flex_attention once; torch's default limit of 8 compiled
    # variants per function would fall back to eager FlexAttention (scores materialised).
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    run = Run(Path(out_dir), smoke, budget_s, reps)
    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if not smoke else "cpu")
    print(json.dumps(env), flush=True)
    if "kernels" in stages:
        kernel_stage(run, torch.bfloat16, run.seqs, layouts)
    if "fp32" in stages:
        kernel_stage(run, torch.float32, run.seqs[:1], layouts, names=("flex", "numba", "torch"))
    if "gpt" in stages:
        gpt_stage(run, step_cap_s)
    text = f"{json.dumps(env)}\n\n" + table(run)
    path = run.out_dir / "table.md"
    path.write_text(text)
    print(text)
    return path
