"""Scale: the largest GPT each contestant trains for 3 steps (loss decreasing) under a memory cap.

Contestants, one process each (world size 1, gloo), fp32, Adam, one fixed batch:

* ``torch``: plain PyTorch, ``torch.optim.Adam(fused=True)``;
* ``zkit-cpu``: zkit stage 3, ``offload_optimizer`` and ``offload_param`` on ``cpu``;
* ``zkit-nvme``: zkit stage 3, both on ``nvme`` (``max_in_cpu`` 0: every shard in swap files);
* ``zkit-nvme-sib``: the same with ``offload_optimizer.step_in_backward`` (each sub-group steps
  during backward as soon as its gradients are complete);
* ``ds-cpu`` / ``ds-nvme``: DeepSpeed's equivalents (same config keys), in DeepSpeed's interpreter.

zkit builds the model under ``zkit.zero.Init(config=...)``, as a user training a model larger than
memory must; plain PyTorch and DeepSpeed build it whole (under ``deepspeed.zero.Init`` this GPT,
whose ``__init__`` re-initialises its children's weights, reported a loss of 0.0 at every step).

Each attempt runs in a child process inside its own memory cgroup (``--cap-gib``; see
:mod:`bench_offload_common`), so a size that does not fit is killed by the kernel. Sizes are GPT
depths at a fixed width: doubled from 1 layer until an attempt fails, then bisected between the
last success and the first failure (``--depths`` tries given depths instead). Reported: parameters,
the cgroup's peak (anonymous memory and page cache), the child's peak RSS and the step time (the
median of the steps after the first, which creates the optimizer state); for the NVMe contestants
also the bytes read and written per step (``/proc/self/io``) and the disk bound: those bytes at the
swapper's read and write bandwidth, measured at the start of the run. Example (about an hour at
4 GiB)::

    python contrib/bench/bench_offload_scale.py --cap-gib 4 --nvme-path /tmp \\
        --ds-python /tmp/dsvenv/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULT = "OFFLOAD_SCALE_RESULT "
VARIANTS = ("torch", "zkit-cpu", "zkit-nvme", "zkit-nvme-sib", "ds-cpu", "ds-nvme")
STEPS = 3


def gpt_config(layers: int, d_model: int):
    from zkit.models.gpt import GPTConfig

    return GPTConfig(vocab_size=8192, seq_len=64, n_layer=layers, n_head=max(1, d_model // 64), d_model=d_model)


def offload_config(variant: str, nvme_path: str, param_buffers: int = 3, opt_buffers: int = 2) -> dict[str, Any]:
    """The zkit / DeepSpeed config (the same keys for both) of an offload contestant;
    ``param_buffers``: ``offload_param.buffer_count`` with NVMe, ``opt_buffers``:
    ``offload_optimizer.buffer_count``."""
    device = variant.split("-")[1]
    opt: dict[str, Any] = {"device": device, "pin_memory": False}
    if variant.endswith("-sib"):
        opt["step_in_backward"] = True
    param: dict[str, Any] = {"device": device, "pin_memory": False}
    if device == "nvme":
        # small host buffers: 2 sub-groups of 5M elements' state, 3 parameter shards by default
        opt.update(nvme_path=nvme_path, buffer_count=opt_buffers)
        param.update(nvme_path=nvme_path, buffer_count=param_buffers, buffer_size=100_000_000, max_in_cpu=0)
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": opt,
            "offload_param": param,
            "sub_group_size": 5_000_000,
            "stage3_param_persistence_threshold": 10_000,
            "stage3_prefetch_bucket_size": 20_000_000,
            "stage3_max_live_parameters": 100_000_000,
            "reduce_bucket_size": 20_000_000,
        },
        "aio": {"block_size": 1_048_576, "queue_depth": 8, "intra_op_parallelism": 1},
        "steps_per_print": 10_000,
    }


def steady_step(times: list[float]) -> int:
    """The index of the step an attempt reports: the median of the steps after the first (the
    slower of two). The first step creates the optimizer state, so it reads no moments from NVMe
    and moves a third fewer bytes than every later step."""
    later = list(range(1, len(times))) or [0]
    return sorted(later, key=times.__getitem__)[len(later) // 2]


# -- child side -------------------------------------------------------------------------------------
def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def child(variant: str, layers: int, d_model: int, nvme_path: str, param_buffers: int = 3,
          opt_buffers: int = 2) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from zkit.models.gpt import GPT

    torch.set_num_threads(2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = gpt_config(layers, d_model)
    torch.manual_seed(0)
    config = offload_config(variant, nvme_path, param_buffers, opt_buffers) if variant != "torch" else None
    if variant.startswith("zkit"):
        import zkit.zero

        with zkit.zero.Init(config=config):
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    batch = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    phases: list = []  # per step: [seconds, bytes read, bytes written] of forward, backward, step
    if variant == "torch":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)

        def step() -> float:
            loss = model(batch, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
    elif variant.startswith("zkit"):
        import zkit

        engine, *_ = zkit.initialize(model=model, config=config)

        def step() -> float:
            marks = [_mark()]
            loss = engine(batch, batch)
            marks.append(_mark())
            engine.backward(loss)
            marks.append(_mark())
            engine.step()
            marks.append(_mark())
            phases.append([[b[i] - a[i] for i in range(3)] for a, b in zip(marks, marks[1:])])
            return loss.item()
    else:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config, dist_init_required=False)

        def step() -> float:
            marks = [_mark()]
            loss = engine(batch, batch)
            marks.append(_mark())
            engine.backward(loss)
            marks.append(_mark())
            engine.step()
            marks.append(_mark())
            phases.append([[b[i] - a[i] for i in range(3)] for a, b in zip(marks, marks[1:])])
            return loss.item()
    if variant != "torch":
        del model  # the engine holds what it needs (stage 3: the shards)
    losses, times, io = [], [], []
    for _ in range(STEPS):
        before = _storage_io()
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
        after = _storage_io()
        io.append([after[0] - before[0], after[1] - before[1]])
    return {"params": params, "losses": losses, "times": times, "peak_rss": _peak_rss(), "io": io, "phases": phases}


def _mark() -> tuple[float, int, int]:
    return (time.perf_counter(), *_storage_io())


def _storage_io() -> tuple[int, int]:
    """Bytes this process has read from and written to storage, by the kernel's count
    (``/proc/self/io``: block-device traffic, O_DIRECT included, page-cache hits excluded)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


# -- parent side ------------------------------------------------------------------------------------
def attempt(variant: str, layers: int, args: argparse.Namespace) -> dict[str, Any]:
    # a directory per attempt: a child killed at the cap leaves its swap files behind
    nvme_dir = tempfile.mkdtemp(prefix="offload-scale-", dir=args.nvme_path)
    try:
        return _attempt(variant, layers, args, nvme_dir)
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)


def _attempt(variant: str, layers: int, args: argparse.Namespace, nvme_dir: str) -> dict[str, Any]:
    from bench_offload_common import CappedRun

    python = args.ds_python if variant.startswith("ds") else sys.executable
    cmd = [python, os.path.abspath(__file__), "--child", variant, "--layers", str(layers),
           "--d-model", str(args.d_model), "--nvme-path", nvme_dir, "--param-buffers", str(args.param_buffers),
           "--opt-buffers", str(args.opt_buffers)]
    env = dict(os.environ, OMP_NUM_THREADS="2", NUMBA_NUM_THREADS="2", PYTHONNOUSERSITE="1",
               PYTHONWARNINGS="ignore")
    if variant.startswith("ds"):
        from zero_deepspeed_side import deepspeed_command

        _, ds_env = deepspeed_command(python, [], args.shim_dir)
        env.update(DS_ACCELERATOR="cpu", PYTHONPATH=ds_env["PYTHONPATH"])
    with CappedRun(int(args.cap_gib * 2**30)) as cap:
        proc = cap.run(cmd, env, args.timeout)
        peak, oom = cap.peak_bytes(), cap.oom_killed()
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            out = json.loads(line[len(RESULT):])
            out["cgroup_peak"] = peak
            decreasing = out["losses"][-1] < out["losses"][0]
            out["ok"] = decreasing
            out["note"] = "" if decreasing else f"loss did not decrease: {out['losses']}"
            return out
    note = "killed at the memory cap" if oom else (proc.stderr.strip().splitlines() or ["failed"])[-1][:160]
    return {"ok": False, "note": note, "cgroup_peak": peak}


def search(variant: str, args: argparse.Namespace, log) -> tuple[int, dict[str, Any] | None, list]:
    """Double the depth until a failure, then bisect; the deepest success and every attempt."""
    tried: list[tuple[int, dict[str, Any]]] = []

    def run(layers: int) -> bool:
        r = attempt(variant, layers, args)
        tried.append((layers, r))
        log(f"  {variant:9s} {layers:4d} layers: " + (f"ok, {r['params'] / 1e6:.0f}M params, cgroup peak "
            f"{r['cgroup_peak'] / 2**30:.2f} GiB, step {r['times'][steady_step(r['times'])]:.1f} s" if r["ok"] else r["note"]))
        return r["ok"]

    if args.depths:  # given depths, in order, until one fails
        good = 0
        for layers in args.depths:
            if not run(layers):
                break
            good = layers
        return good, dict(tried).get(good), tried
    good, bad = 0, None
    layers = 1
    while layers <= args.max_layers:
        if not run(layers):
            bad = layers
            break
        good, layers = layers, layers * 2
    if bad is not None:
        while bad - good > max(1, good // args.precision):  # bisect to within 1/precision of the size
            mid = (good + bad) // 2
            if run(mid):
                good = mid
            else:
                bad = mid
    best = dict(tried)[good] if good else None
    return good, best, tried


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cap-gib", type=float, default=4.0, help="memory cap per attempt (GiB)")
    p.add_argument("--nvme-path", default=tempfile.gettempdir(), help="directory for swap files")
    p.add_argument("--ds-python", default="/tmp/dsvenv/bin/python", help="DeepSpeed's interpreter ('' to skip)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--max-layers", type=int, default=512)
    p.add_argument("--precision", type=int, default=8, help="bisect until within 1/precision of the depth found")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per attempt")
    p.add_argument("--depths", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="try these depths in order (stop at the first failure) instead of doubling and bisecting")
    p.add_argument("--disk-mb", type=int, default=2048, help="size of the disk bandwidth probe (0: skip it)")
    p.add_argument("--plot", default="bench_offload_scale.png",
                   help="PNG of step time and cgroup peak against model size ('' for none; needs matplotlib)")
    p.add_argument("--param-buffers", type=int, default=3,
                   help="offload_param.buffer_count of the NVMe contestants (parameter shards read ahead)")
    p.add_argument("--opt-buffers", type=int, default=2,
                   help="offload_optimizer.buffer_count of the NVMe contestants (sub-groups of optimizer state in "
                        "host memory: 2 makes a read wait for the write before it, 3 or more overlap them)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sys.path[:0] = [HERE, REPO]
    if args.child:
        print(RESULT + json.dumps(child(args.child, args.layers, args.d_model, args.nvme_path, args.param_buffers,
                                          args.opt_buffers)),
              flush=True)
        return 0
    variants = [v for v in args.variants.split(",") if v and (args.ds_python or not v.startswith("ds"))]
    args.shim_dir = tempfile.mkdtemp(prefix="zkit-ds-shim-")
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    log(f"cap {args.cap_gib} GiB per attempt, width {args.d_model}, load average {os.getloadavg()}")
    disks = None
    probe_disk = args.disk_mb and any("nvme" in v for v in variants)
    if probe_disk:
        disks = disk_bandwidth(args.nvme_path, args.disk_mb)
        for name, (w, r) in disks.items():
            log(f"disk before, {name}: the NVMe swapper at the contestants' aio settings writes {w:.2f} GB/s and "
                f"reads {r:.2f} GB/s ({args.disk_mb} MiB, O_DIRECT)")
    rows, series = [], []
    for v in variants:
        layers, best, tried = search(v, args, log)
        rows.append((v, layers, best))
        series.append(size_series(v, tried, args.d_model))
    if probe_disk:
        # This kind of disk (a virtual one) moves by a third from one probe to the next: the bound
        # takes the mean of a probe before the contestants and one after.
        after = disk_bandwidth(args.nvme_path, args.disk_mb)
        for name, (w, r) in after.items():
            log(f"disk after, {name}: writes {w:.2f} GB/s and reads {r:.2f} GB/s")
        disks = {name: ((w + after[name][0]) / 2, (r + after[name][1]) / 2) for name, (w, r) in disks.items()}
    from bench_offload_common import print_size_table

    print(f"\nLargest GPT (d_model {args.d_model}) training {STEPS} steps under a {args.cap_gib} GiB cap; "
          f"load average {os.getloadavg()[0]:.1f}")
    print_size_table(rows, [("cgroup peak GiB", lambda b: f"{b['cgroup_peak'] / 2**30:.2f}"),
                            ("peak RSS GiB", lambda b: f"{b['peak_rss'] / 2**30:.2f}"),
                            ("step s", lambda b: f"{b['times'][steady_step(b['times'])]:.2f}")])
    if disks is not None:
        names = list(disks)
        bound = lambda r, w, name: r / (disks[name][1] * 1e9) + w / (disks[name][0] * 1e9)  # noqa: E731
        print("\nDisk traffic per step (the median of the steps after the first; /proc/self/io) against the disk bound: bytes read / read "
              "bandwidth + bytes written / write bandwidth, with the swapper's bandwidth measured in this run (mean of a probe before and one after) "
              + " and ".join(f"{n} ({disks[n][1]:.2f} GB/s read, {disks[n][0]:.2f} GB/s write)" for n in names) + ":")
        print("| contestant | params | read GB | written GB | bytes / param | step s | "
              + " | ".join(f"bound s, {n} | step / bound" for n in names) + " |")
        print("|---|---|---|---|---|---|" + "---|---|" * len(names))
        phase_lines = []
        for v, layers, b in rows:
            if b is None or "io" not in b or "nvme" not in v:
                continue
            i = steady_step(b["times"])
            read, written = b["io"][i]
            cells = " | ".join(f"{bound(read, written, n):.1f} | {b['times'][i] / bound(read, written, n):.2f}" for n in names)
            print(f"| {v} | {b['params'] / 1e6:.0f}M | {read / 1e9:.2f} | {written / 1e9:.2f} | "
                  f"{(read + written) / b['params']:.1f} | {b['times'][i]:.1f} | {cells} |")
            if b.get("phases"):
                cells = [f"{name} {sec:.1f} s, read {r / 1e9:.2f} GB, written {w / 1e9:.2f} GB (bound "
                         + ", ".join(f"{bound(r, w, n):.1f} s {n}" for n in names) + ")"
                         for name, (sec, r, w) in zip(("forward", "backward", "step"), b["phases"][i])]
                phase_lines.append(f"{v} at {b['params'] / 1e6:.0f}M: " + "; ".join(cells))
        print("\n".join(phase_lines))
    if args.plot:
        from bench_plots import plot_sizes

        print(plot_sizes(series, int(args.cap_gib * 2**30), args.plot, f"one process, width {args.d_model}",
                         "cgroup peak (GiB)"))
    return 0


def size_series(variant: str, tried: list[tuple[int, dict[str, Any]]], d_model: int):
    """A contestant's attempts as a plot series: the sizes that trained (steady step, cgroup
    peak) in order of size, and the smallest that failed."""
    from bench_plots import Series

    good = sorted((r["params"], r["times"][steady_step(r["times"])], r["cgroup_peak"])
                  for _, r in tried if r["ok"])
    failed = sorted(layers for layers, r in tried if not r["ok"])
    failed_at = gpt_config(failed[0], d_model).num_parameters() if failed else None
    return Series(variant, good, failed_at)


def disk_bandwidth(directory: str, size_mb: int) -> dict[str, tuple[float, float]]:
    """(write, read) GB/s of zkit-offload's swapper with the contestants' aio settings (1 MiB
    blocks, queue depth 8), on files in ``directory``, measured two ways:

    * ``one file``: ``size_mb`` written as one tensor and read back at once (best of 2);
    * ``20 MiB files``: the same bytes as 20 MiB pieces in files of their own, read back after
      all were written, as the optimizer step moves its sub-group tensors;
    * ``20 MiB files read and written at once``: those pieces read while others are rewritten,
      as the step pipeline does (one figure for both directions: the bytes of both over the time).

    On the virtual disk this was written on, the figures differ by up to 2x and each moves by a
    third between probes: one file went fastest, pieces read alone slowest, and reading while
    writing moved more bytes than either alone."""
    from bench_nvme_swap import swapper_bandwidth, swapper_piecewise_bandwidth

    probe = tempfile.mkdtemp(prefix="offload-scale-disk-", dir=directory)
    try:
        whole = swapper_bandwidth(probe, size_mb, block_size=1 << 20, threads=8, rounds=2)
        pieces = swapper_piecewise_bandwidth(probe, size_mb, 20, block_size=1 << 20, threads=8)
        return {"one file": whole, "20 MiB files": pieces[:2], "20 MiB files read and written at once": (pieces[2], pieces[2])}
    finally:
        shutil.rmtree(probe, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
