"""Peak activation memory and step time of the small GPT: no checkpointing, checkpointing every
block, and checkpointing with host copies (``cpu_checkpointing``).

    python contrib/bench/bench_activation_checkpointing.py [--preset small] [--batch 16] [--steps 5]

Activation memory is measured as the peak of bytes held for backward (saved-tensor hooks that
count live storages, parameters excluded) - the same on every device - and, on CUDA, also as the
allocator's peak above the model states. Host bytes are what ``cpu_checkpointing`` keeps in host
memory. Step time is forward + backward, best of ``--steps``.
"""
from __future__ import annotations

import argparse
import time
import weakref

import torch

import zkit.activations.recompute as ckpt
from zkit.zero.device_allocator import DeviceAllocator
from zkit.estimator import gpt_activation_bytes
from zkit.models.gpt import GPT, GPTConfig


class SavedBytes:
    """Live and peak bytes of tensors autograd keeps for backward (outermost hooks)."""

    def __init__(self, params) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.live = self.peak = 0
        self.seen: dict[int, int] = {}

    def pack(self, t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.params and key not in self.seen and t.device.type != "meta":
            self.seen[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._drop, key)
        return t

    def _drop(self, key):
        self.live -= self.seen.pop(key, 0)


def run(mode: str, cfg: GPTConfig, batch: int, steps: int, device: torch.device) -> dict:
    ckpt.reset()
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    alloc = DeviceAllocator(device)
    if mode != "none":
        ckpt.apply(model, "every")
        engine = type("E", (), {})()
        from zkit.core.config import load_config

        engine.config = load_config({"train_batch_size": 1, "activation_checkpointing": {"cpu_checkpointing": mode == "cpu"}},
                                    world_size=1)
        engine.allocator = alloc
        ckpt.configure(engine)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device=device)
    best = float("inf")
    peak_saved = peak_dev = 0
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        counter = SavedBytes(model.parameters())
        if device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            loss = model(ids, ids)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak_dev = torch.cuda.max_memory_allocated() - base
        best = min(best, time.perf_counter() - start)
        peak_saved = counter.peak
    host = alloc.stats().get("activation", {}).get("peak", 0)
    return {"mode": mode, "step_s": best, "saved": peak_saved, "host": host, "device_peak": peak_dev}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dropout", type=float, default=0.1)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = GPTConfig.preset(args.preset, dropout=args.dropout)
    rows = [run(m, cfg, args.batch, args.steps, device) for m in ("none", "every", "cpu")]
    est = {ck: gpt_activation_bytes(cfg, args.batch, dtype_bytes=4, checkpointing=ck)["saved"] for ck in (False, True)}
    print(f"GPT {args.preset} ({cfg.num_parameters():,} params), batch {args.batch}, seq {cfg.seq_len}, fp32, {device}")
    print(f"{'mode':<22}{'saved for backward MiB':>24}{'host MiB':>10}{'device peak MiB':>17}{'step ms':>10}{'x time':>8}")
    base = rows[0]["step_s"]
    names = {"none": "no checkpointing", "every": "checkpoint every block", "cpu": "  + cpu_checkpointing"}
    for r in rows:
        print(f"{names[r['mode']]:<22}{r['saved'] / 2**20:>24.2f}{r['host'] / 2**20:>10.2f}"
              f"{r['device_peak'] / 2**20:>17.2f}{r['step_s'] * 1e3:>10.1f}{r['step_s'] / base:>8.2f}")
    print(f"estimator (saved, flash attention): none {est[False] / 2**20:.2f} MiB, checkpointed {est[True] / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
