"""Host memory and time of ``zkit consolidate`` on a DeepSpeed ZeRO-3 checkpoint larger than memory.

DeepSpeed's ``zero_to_fp32`` holds the whole fp32 model in host memory (and, at stages 1-2, twice).
This writes a DeepSpeed stage-3 checkpoint of ``--params`` fp32 parameters over ``--ranks`` rank
files in DeepSpeed's layout (``latest``, ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``,
``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` with ``fp32_flat_groups``), filling the tensor bytes
in place so that writing it needs no memory either, then runs ``zkit consolidate`` on it in a child
process and reports the child's peak resident set (``ru_maxrss``) next to the model size::

    python contrib/bench/bench_deepspeed_consolidate.py --dir /tmp/dsbig --params 3e9 --out-dtype bf16

The optimizer files carry the fp32 master weights only (no ``exp_avg``/``exp_avg_sq``): consolidation
never reads the optimizer state, and leaving it out keeps the disk footprint to the model's size.
The checkpoint and the output are deleted afterwards unless ``--keep``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import torch

CHUNK = 1 << 24  # elements written at a time


def _layout_and_fill(obj, path: Path, fill) -> None:
    """``torch.save`` ``obj`` (fake tensors) without data, then write each storage's bytes in place
    with ``fill(key, numel, write)``."""
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(obj, path)
    with open(path, "r+b") as f, zipfile.ZipFile(path) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if len(parts) == 3 and parts[1] == "data" and parts[2].isdigit():
                f.seek(info.header_offset)
                local = f.read(30)
                name_len, extra_len = struct.unpack("<HH", local[26:30])
                start = info.header_offset + 30 + name_len + extra_len

                def write(offset: int, values: torch.Tensor, start=start) -> None:
                    os.pwrite(f.fileno(), values.numpy().tobytes(), start + offset)

                fill(int(parts[2]), info.file_size // 4, write)


def write_checkpoint(root: Path, shapes: dict[str, tuple[int, ...]], ranks: int) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    where = root / "global_step1"
    where.mkdir(parents=True)
    per_rank = sum(math.ceil(math.prod(s) / ranks) for s in shapes.values())
    gen = torch.Generator().manual_seed(0)

    def fill(_key: int, numel: int, write) -> None:
        for lo in range(0, numel, CHUNK):
            n = min(CHUNK, numel - lo)
            write(lo * 4, torch.randn(n, generator=gen) * 0.02)

    for rank in range(ranks):
        with FakeTensorMode():
            flat = torch.empty(per_rank, dtype=torch.float32)
            model = {"module": {}, "buffer_names": [], "param_shapes": [{n: torch.Size(s) for n, s in shapes.items()}],
                     "frozen_param_shapes": {}, "frozen_param_fragments": {}, "shared_params": {},
                     "global_steps": 1, "global_samples": 1, "skipped_steps": 0, "dp_world_size": ranks,
                     "mp_world_size": 1, "lr_scheduler": None, "ds_version": "0.19.8"}
            optim = {"optimizer_state_dict": {"zero_stage": 3, "partition_count": ranks, "loss_scale": None,
                                              "optimizer_state_dict": {"state": {}, "param_groups": []},
                                              "fp32_flat_groups": [flat]}}
        torch.save(model, where / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        _layout_and_fill(optim, where / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", fill)
    (root / "latest").write_text("global_step1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="where to write the checkpoint (needs the model's size on disk)")
    parser.add_argument("--params", type=float, default=3e9)
    parser.add_argument("--tensors", type=int, default=24, help="parameters the model is split into")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out-dtype", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    root = Path(args.dir)
    if root.exists():
        raise SystemExit(f"{root} exists; pass a new directory")
    width = int(math.sqrt(args.params / args.tensors))
    shapes = {f"layers.{i}.w": (width + i % 3, width) for i in range(args.tensors)}
    numel = sum(math.prod(s) for s in shapes.values())
    try:
        t0 = time.perf_counter()
        write_checkpoint(root / "ckpt", shapes, args.ranks)
        written = time.perf_counter() - t0
        out = root / f"model.{args.out_dtype}.safetensors"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "zkit.cli", "consolidate", str(root / "ckpt"), str(out),
                        "--dtype", args.out_dtype], check=True)
        seconds = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        with open("/proc/meminfo") as f:
            mem = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        print(json.dumps({
            "params": numel, "tensors": len(shapes),
            "model_fp32_bytes": numel * 4, "largest_tensor_fp32_bytes": max(math.prod(s) for s in shapes.values()) * 4,
            "machine_memory_bytes": mem["MemTotal"], "peak_rss_bytes": peak, "consolidate_seconds": round(seconds, 1),
            "write_checkpoint_seconds": round(written, 1), "out_bytes": out.stat().st_size,
        }, indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
