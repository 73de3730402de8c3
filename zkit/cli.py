"""The ``zkit`` command: ``run`` (torchrun), ``consolidate``, ``plugins``, ``report``, ``estimate``.

    zkit run --nproc 2 train.py --my-arg 1        # launch ranks with torch.distributed's own launcher
    zkit -p no:offload plugins                    # block a plugin, list what every family offers
    zkit report                                   # versions, backends, kernels, plugins
    zkit consolidate ckpt model.safetensors       # a sharded checkpoint (any format that reads pieces) as one state dict
    zkit consolidate ckpt out --format hf --hf-config config.json   # a save_pretrained directory
    zkit estimate --preset gpt2-350m --batch 8    # per-rank memory of every stage/offload/dtype
"""
from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import platform
import subprocess
import sys
from typing import Sequence

from zkit.rank_failures import RankFailure, failure_summary, root_cause_rank


def _blocked(values: Sequence[str]) -> list[str]:
    out = []
    for v in values:
        if not v.startswith("no:"):
            raise SystemExit(f"zkit: -p takes 'no:NAME' to block a plugin, got {v!r}")
        out.append(v[3:])
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zkit", description="zkit: large-model training, a small kernel plus plugins")
    p.add_argument("-p", dest="plugin_opts", action="append", default=[], metavar="no:NAME",
                   help="block the plugin NAME (entry-point or distribution name); repeatable")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="launch a training script on N ranks (torchrun underneath)")
    run.add_argument("--nproc", "--nproc-per-node", dest="nproc", default="1",
                     help="ranks on this node (a number, or 'auto')")
    run.add_argument("--nnodes", default="1", help="number of nodes, or MIN:MAX for elastic jobs")
    run.add_argument("--node-rank", type=int, default=0)
    run.add_argument("--master-addr", default="127.0.0.1")
    run.add_argument("--master-port", type=int, default=None,
                     help="rendezvous port (default: a free port on a single node, 29500 across nodes)")
    run.add_argument("--rdzv-backend", default=None, help="torchrun rendezvous backend (default: static)")
    run.add_argument("--rdzv-endpoint", default=None)
    run.add_argument("--rdzv-id", default=None)
    run.add_argument("--max-restarts", type=int, default=0)
    run.add_argument("--threads-per-rank", type=int, default=None,
                     help="OMP/torch threads per rank (default: cores / ranks)")
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)

    cons = sub.add_parser("consolidate", help="write a sharded checkpoint (zkit's or DeepSpeed's) as one state dict "
                                              "(.pt, .bin or .safetensors) or a Hugging Face or DCP directory")
    cons.add_argument("checkpoint", help="the directory given to save_checkpoint, or one tag's directory")
    cons.add_argument("out", help="output file: .pt or .bin (torch.load) or .safetensors; a directory with --format "
                                  "hf or dcp")
    cons.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    cons.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32",
                      help="dtype of floating-point tensors in the output (default: fp32)")
    cons.add_argument("--format", default="file", type=str.lower,
                      help="file: one state dict (by the suffix); or a checkpoint format that exports (zkit plugins "
                           "lists them): hf, a Hugging Face save_pretrained directory (needs --hf-config); dcp, a "
                           "PyTorch Distributed Checkpoint directory (torchtitan, FSDP2)")
    cons.add_argument("--hf-config", default=None,
                      help="with --format hf: the model's save_pretrained directory or its config.json")
    cons.add_argument("--max-shard-bytes", type=int, default=None,
                      help="with --format hf: the largest safetensors shard (default 5e9 bytes)")

    sub.add_parser("plugins", help="list every family's records with their distributions")
    sub.add_parser("report", help="versions, backends, kernels and plugins of this environment")

    est = sub.add_parser("estimate", help="per-rank memory for every ZeRO stage x offload x dtype x world size")
    what = est.add_mutually_exclusive_group(required=True)
    what.add_argument("--preset", help="a GPT preset (zkit.models.gpt.PRESETS), e.g. gpt2-350m")
    what.add_argument("--params", type=float, help="a parameter count (accepts 7e9)")
    what.add_argument("--model", help="MODULE:CALLABLE returning an nn.Module (built on the meta device)")
    est.add_argument("--world-sizes", default="1,2,4,8", help="comma-separated (default 1,2,4,8)")
    est.add_argument("--stages", default="0,1,2,3")
    est.add_argument("--offload", default="none,cpu,cpu+params,nvme")
    est.add_argument("--dtypes", default="fp32,fp16")
    est.add_argument("--batch", type=int, default=None, help="micro-batch size for the activation estimate")
    est.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    est.add_argument("--optimizer", default="adam", help="adam, adamw, lamb, lion, adagrad, sgd-momentum, sgd")
    est.add_argument("--reduce-bucket-size", type=float, default=5e8)
    est.add_argument("--stage3-max-reuse-distance", type=float, default=1e9,
                     help="stage 3: elements within which a gathered parameter is kept for its reuse")
    est.add_argument("--cpu", action="store_true", help="training on the CPU (host and device are one memory)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    blocked = _blocked(args.plugin_opts)
    if blocked:
        # Children (ranks) inherit the environment, so a block applies to the whole job.
        os.environ["ZKIT_BLOCK_PLUGINS"] = ",".join(
            [b for b in os.environ.get("ZKIT_BLOCK_PLUGINS", "").split(",") if b] + blocked
        )
    if args.command == "run":
        return run(args)
    if args.command == "consolidate":
        return consolidate(args)
    if args.command == "estimate":
        print(estimate_text(args))
        return 0
    if args.command == "plugins":
        print(plugins_text())
        return 0
    print(report_text())
    return 0


def run(args: argparse.Namespace) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    nproc = args.nproc
    threads = args.threads_per_rank
    if threads is None and nproc.isdigit():
        threads = max(1, (os.cpu_count() or 1) // int(nproc))
    if threads:
        # Ranks sharing cores must not each start one thread per core.
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        os.environ.setdefault("NUMBA_NUM_THREADS", str(threads))
    targs = [f"--nproc-per-node={nproc}", f"--nnodes={args.nnodes}", f"--max-restarts={args.max_restarts}"]
    if args.rdzv_backend:
        targs += [f"--rdzv-backend={args.rdzv_backend}"]
        if args.rdzv_endpoint:
            targs += [f"--rdzv-endpoint={args.rdzv_endpoint}"]
        if args.rdzv_id:
            targs += [f"--rdzv-id={args.rdzv_id}"]
    else:
        targs += [f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr}",
                  f"--master-port={_master_port(args)}"]
    script_args = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
    os.environ["ZKIT_LAUNCHER_PID"] = str(os.getpid())  # ranks die with this process
    # torchrun's own summary blames the first failure it observed, often a rank that lost its
    # peer; ours names the root cause (zkit.rank_failures).
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_FirstObservedFilter())
    try:
        torchrun.run(torchrun.parse_args([*targs, "-m", "zkit.rank_entry", args.script, *script_args]))
    except ChildFailedError as exc:
        print(failure_summary(exc.failures), file=sys.stderr)
        _pass_root_cause_up(exc.failures[root_cause_rank(exc.failures)])
        return 1
    return 0


class _FirstObservedFilter(logging.Filter):
    """Drops torchrun's "failed (exitcode: ...) local_rank: ..." line: it names the first observed
    failure, which the summary may show to be a consequence."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed (exitcode")


def _pass_root_cause_up(failure: RankFailure) -> None:
    """Under an outer torchelastic agent (this launcher is itself a worker), copy the root cause's
    error file to ours, as torchrun's ``@record`` would copy its first observed failure's."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE") and failure.error_file != "<N/A>":
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().dump_error_file(failure.error_file, failure.exitcode)


def _master_port(args: argparse.Namespace) -> int:
    """The rendezvous port: the one asked for, checked free on the master node (as the rendezvous
    store will bind it, so a port left in TIME_WAIT by the previous run is free); else a free one
    on a single node (a fixed default collides with any other job on the machine)."""
    import socket

    if args.master_port is None:
        if args.nnodes != "1":
            return 29500  # every node must name the same port: DeepSpeed's and torchrun's default
        with socket.socket() as s:
            s.bind((args.master_addr, 0))
            return s.getsockname()[1]
    if args.node_rank == 0:
        with socket.socket() as s:
            # as the rendezvous store binds: a port whose last job's connections linger in
            # TIME_WAIT is free to it; only a socket still bound or listening there is in the way
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((args.master_addr, args.master_port))
            except OSError as exc:
                raise SystemExit(
                    f"zkit run: port {args.master_port} on {args.master_addr} is taken ({exc.strerror}); "
                    f"choose another with --master-port, or leave --master-port out to use a free one"
                ) from None
    return args.master_port


def consolidate(args: argparse.Namespace) -> int:
    """One state dict file (``--format file``), or an export in a checkpoint format's ``export``."""
    from zkit.checkpoint.consolidate import write_consolidated
    from zkit.core.checkpoint_errors import CheckpointError
    from zkit.checkpoint.formats import named
    from zkit.core.plugin_manager import get_plugin_manager

    if args.format != "hf" and (args.hf_config or args.max_shard_bytes):
        raise SystemExit("zkit consolidate: --hf-config and --max-shard-bytes go with --format hf")
    if args.format == "hf" and not args.hf_config:
        raise SystemExit("zkit consolidate --format hf needs --hf-config: the model's save_pretrained directory or "
                         "its config.json (the checkpoint holds weights, not the model's configuration)")
    try:
        pm = get_plugin_manager()
        if args.format != "file":
            export = named(pm, args.format).operation("export")
            options = {"config": args.hf_config, "max_shard_bytes": args.max_shard_bytes} if args.format == "hf" else {}
            print(export(args.checkpoint, args.out, tag=args.tag, dtype=args.dtype, **options).summary())
            return 0
        done = write_consolidated(args.checkpoint, args.out, tag=args.tag, dtype=args.dtype, pm=pm)
    except (CheckpointError, ValueError) as exc:
        raise SystemExit(f"zkit consolidate: {exc}") from None
    tied = done.tensors - done.distinct
    print(
        f"wrote {done.path}: {done.tensors} tensors ({tied} tied aliases), {done.nbytes:,} bytes of tensor data "
        f"({done.dtype}), file {done.path.stat().st_size:,} bytes, from {done.source}"
    )
    return 0


def estimate_text(args: argparse.Namespace) -> str:
    import importlib

    import torch

    from zkit.estimator.command import estimate_memory
    from zkit.models.gpt import GPTConfig

    def ints(text: str, option: str) -> tuple[int, ...]:
        try:
            return tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise SystemExit(f"zkit estimate: {option} takes comma-separated integers, got {text!r}") from None

    options = dict(
        world_sizes=ints(args.world_sizes, "--world-sizes"),
        stages=ints(args.stages, "--stages"),
        offloads=tuple(v.strip() for v in args.offload.split(",") if v.strip()),
        dtypes=tuple(v.strip() for v in args.dtypes.split(",") if v.strip()),
        batch=args.batch,
        seq=args.seq,
        optimizer=args.optimizer,
        reduce_bucket_size=int(args.reduce_bucket_size),
        stage3_max_reuse_distance=int(args.stage3_max_reuse_distance),
        accelerator=not args.cpu,
    )
    try:
        if args.preset:
            return estimate_memory(gpt_config=GPTConfig.preset(args.preset), **options).table()
        if args.params is not None:
            if args.params != int(args.params):
                raise ValueError(f"--params must be a whole number, got {args.params}")
            return estimate_memory(num_params=int(args.params), **options).table()
        module_name, _, attr = args.model.partition(":")
        if not attr:
            raise ValueError(f"--model takes MODULE:CALLABLE, got {args.model!r}")
        factory = getattr(importlib.import_module(module_name), attr)
        with torch.device("meta"):
            model = factory()
        return estimate_memory(model, **options).table()
    except (ValueError, TypeError, ImportError, AttributeError) as exc:
        raise SystemExit(f"zkit estimate: {exc}") from None


def plugins_text() -> str:
    from zkit.core.plugin_manager import get_plugin_manager
    from zkit.core.records import FAMILIES

    pm = get_plugin_manager()
    lines = [f"zkit {_version('zkit')} (built-in plugins are part of the zkit distribution)", "plugins:"]
    for name, plugin in pm.list_name_plugin():
        if plugin is not None:
            lines.append(f"  {name:28s} {pm.dist_of(plugin)}")
    for family in FAMILIES:
        lines.append(f"{family}:")
        seen = set()
        for rec in pm.records(family).values():
            if id(rec) in seen:
                continue
            seen.add(id(rec))
            aliases = f" (aliases: {', '.join(rec.aliases)})" if rec.aliases else ""
            extra = f" [{rec.kind}]" if family == "scheduler" else ""
            lines.append(f"  {rec.name:22s} {rec.dist:24s} {rec.description}{extra}{aliases}")
        if not seen:
            lines.append("  (none)")
    lines.append("checkpoint format:")
    for rec in pm.checkpoint_formats().values():
        lines.append(f"  {rec.name:22s} {rec.dist:24s} {rec.description} [{', '.join(rec.provides())}]")
    sections = pm.config_sections()
    if sections:
        lines.append("config sections:")
        for path, rec in sorted(sections.items()):
            lines.append(f"  {path:40s} {rec.dist}")
    lines.append("lifecycle hooks (implementations, called outermost first):")
    for name in sorted(n for n in dir(pm.hook) if n.startswith("zkit_") and not n.startswith("zkit_register_")):
        impls = getattr(pm.hook, name).get_hookimpls()
        if not impls:
            continue
        shown = []
        for impl in reversed(impls):  # pluggy calls the last registered first
            flags = [f for f in ("wrapper", "hookwrapper", "tryfirst", "trylast") if getattr(impl, f, False)]
            shown.append(pm.get_name(impl.plugin) + (f" ({', '.join(flags)})" if flags else ""))
        lines.append(f"  {name:28s} {', '.join(shown)}")
    return "\n".join(lines)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


_SIMULATOR_PROBE = """
import numpy as np
from numba import cuda
@cuda.jit
def inc(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] += 1
a = np.zeros(8, dtype=np.float32)
inc[1, 8](a)
assert a.sum() == 8
"""


def report_text() -> str:
    import torch
    import torch.distributed as dist

    from zkit.core.plugin_manager import get_plugin_manager

    lines = [
        f"zkit {_version('zkit')}  python {platform.python_version()}  {platform.platform()}",
        f"torch {torch.__version__}  pluggy {_version('pluggy')}  attrs {_version('attrs')}  msgpack {_version('msgpack')}",
        f"backends: gloo {'yes' if dist.is_gloo_available() else 'no'}, nccl {'yes' if dist.is_nccl_available() else 'no'}, "
        f"cuda {'yes: ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'no'}",
    ]
    numba_version = _version("numba")
    lines.append(f"numba {numba_version}  numba-cuda {_version('numba-cuda')}")
    if numba_version != "not installed":
        try:
            from numba import cuda

            lines.append(f"numba CUDA device: {'yes' if cuda.is_available() else 'no (no driver or GPU)'}")
        except Exception as exc:  # report, never crash
            lines.append(f"numba CUDA: import failed ({exc})")
        probe = subprocess.run(
            [sys.executable, "-c", _SIMULATOR_PROBE],
            env={**os.environ, "NUMBA_ENABLE_CUDASIM": "1"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines.append(
            "numba CUDA simulator: works" if probe.returncode == 0
            else f"numba CUDA simulator: fails ({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else probe.returncode})"
        )
    pm = get_plugin_manager()
    lines.append("plugins:")
    for name, plugin in pm.list_name_plugin():
        if plugin is not None:
            lines.append(f"  {name:28s} {pm.dist_of(plugin)}")
    for topic, text in (item for result in pm.hook.zkit_report() for item in (result or ())):
        lines.append(f"{topic}: {text}")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
