"""``deepspeed.launcher.runner``: DeepSpeed's ``deepspeed`` command on one node, run by ``zkit run``.

    deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config ds_config.json

starts 2 ranks of ``train.py`` as DeepSpeed's launcher does: ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, and ``--local_rank=N`` put before the
script's own arguments (``--no_local_rank`` leaves it out). ``zkit run`` (torchrun) starts them, so
they also die with the launcher and report a failing rank's traceback. Several nodes, host files
and DeepSpeed's other launchers (pdsh, MPI, SLURM) are refused with what to run instead: torchrun's
rendezvous, ``zkit run --nnodes N``, replaces them.

Accelerate's ``accelerate launch --use_deepspeed`` imports ``DEEPSPEED_ENVIRONMENT_NAME`` from here.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

#: DeepSpeed's name for the per-job environment file (``DS_ENV_FILE`` overrides it, as there)
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
#: DeepSpeed's default host file: used only when it exists, which means several nodes
DLTS_HOSTFILE = "/job/hostfile"

_MULTI_NODE = ("the deepspeed drop-in launches one node; for several nodes run `zkit run --nnodes N --node-rank R "
               "--master-addr HOST --nproc NPROC script.py ...` on each node (torchrun's rendezvous)")


class LaunchError(SystemExit):
    """A launcher option the drop-in cannot honour; the message says what to use instead."""

    def __init__(self, message: str) -> None:
        super().__init__(f"deepspeed (zkit drop-in): {message}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepspeed", description="DeepSpeed's launcher on one node, run by zkit run")
    p.add_argument("-H", "--hostfile", default=DLTS_HOSTFILE)
    p.add_argument("-i", "--include", default="")
    p.add_argument("-e", "--exclude", default="")
    p.add_argument("--num_nodes", type=int, default=-1)
    p.add_argument("--num_gpus", "--num_accelerators", dest="num_gpus", type=int, default=-1)
    p.add_argument("--master_port", type=int, default=None)
    p.add_argument("--master_addr", default="")
    p.add_argument("--node_rank", type=int, default=-1)
    p.add_argument("--launcher", default="pdsh")
    p.add_argument("--launcher_args", default="")
    p.add_argument("--module", action="store_true")
    p.add_argument("--no_python", action="store_true")
    p.add_argument("--no_local_rank", action="store_true")
    p.add_argument("--no_ssh", action="store_true")
    p.add_argument("--no_ssh_check", action="store_true")
    p.add_argument("--force_multi", action="store_true")
    p.add_argument("--save_pid", action="store_true")
    p.add_argument("--enable_each_rank_log", default="None")
    p.add_argument("--autotuning", default="")
    p.add_argument("--elastic_training", action="store_true")
    p.add_argument("--min_elastic_nodes", type=int, default=-1)
    p.add_argument("--max_elastic_nodes", type=int, default=-1)
    p.add_argument("--bind_cores_to_rank", action="store_true")
    p.add_argument("--bind_core_list", default=None)
    p.add_argument("--ssh_port", type=int, default=None)
    p.add_argument("--venv_script", default=None)
    p.add_argument("--log_level", default="info")  # the launcher's own log lines
    p.add_argument("-q", "--quiet", action="store_true")
    p.add_argument("user_script")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    return p


def _refuse_unsupported(a: argparse.Namespace) -> None:
    if a.num_nodes > 1 or a.force_multi or a.node_rank > 0 or (a.hostfile != DLTS_HOSTFILE or Path(a.hostfile).exists()):
        given = "--hostfile" if a.hostfile != DLTS_HOSTFILE or Path(a.hostfile).exists() else (
            "--num_nodes" if a.num_nodes > 1 else "--force_multi" if a.force_multi else "--node_rank")
        raise LaunchError(f"{given}: {_MULTI_NODE}")
    flags = {
        "--autotuning": (a.autotuning, "DeepSpeed's autotuner is not part of zkit"),
        "--elastic_training": (a.elastic_training, "use `zkit run --nnodes MIN:MAX` (torchrun's elastic rendezvous)"),
        "--no_python": (a.no_python, "zkit run starts Python scripts and modules only"),
        "--bind_cores_to_rank": (a.bind_cores_to_rank, "use `zkit run --threads-per-rank N` to share the cores"),
        "--bind_core_list": (a.bind_core_list, "use `zkit run --threads-per-rank N` to share the cores"),
        "--enable_each_rank_log": (a.enable_each_rank_log != "None", "torchrun's --log-dir keeps per-rank logs"),
        "--venv_script": (a.venv_script, "it is for the nodes DeepSpeed's multi-node launchers reach over ssh"),
        "--save_pid": (a.save_pid, "torchrun's process is the job's; `zkit run` ends the ranks when it ends"),
        "--launcher_args": (a.launcher_args, _MULTI_NODE),
    }
    for flag, (given, instead) in flags.items():
        if given:
            raise LaunchError(f"{flag} is not supported: {instead}")


def _local_devices(a: argparse.Namespace) -> tuple[int, str | None]:
    """Ranks on this node and, with ``--include/--exclude localhost:...``, CUDA_VISIBLE_DEVICES."""
    import torch

    available = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    chosen = available
    for flag, spec in (("--include", a.include), ("--exclude", a.exclude)):
        if not spec:
            continue
        host, _, slots = spec.partition(":")
        if host not in ("localhost", "127.0.0.1") or "@" in spec or not slots:
            raise LaunchError(f"{flag} {spec!r}: only 'localhost:0,1,...' (this node's devices) is supported; "
                              f"{_MULTI_NODE}")
        try:
            ids = [int(s) for s in slots.split(",")]
        except ValueError:
            raise LaunchError(f"{flag} {spec!r}: device numbers must be integers") from None
        missing = [i for i in ids if i not in available]
        if missing:
            raise LaunchError(f"{flag} {spec!r}: no device {missing[0]} on this node ({len(available)} CUDA devices)")
        chosen = [i for i in chosen if i in ids] if flag == "--include" else [i for i in chosen if i not in ids]
    restricted = bool(a.include or a.exclude)
    if a.num_gpus > 0:
        if restricted and a.num_gpus > len(chosen):
            raise LaunchError(f"--num_gpus {a.num_gpus} with only {len(chosen)} devices left by --include/--exclude")
        chosen = chosen[: a.num_gpus] if chosen else chosen
        nproc = a.num_gpus
    else:
        nproc = max(1, len(chosen))  # a CPU machine: one rank unless --num_gpus says otherwise
    if restricted and not chosen:
        raise LaunchError("--include/--exclude leave no device to run on")
    return nproc, (",".join(map(str, chosen)) if restricted else None)


def command(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The ``zkit run`` command line and the extra environment that ``deepspeed argv`` means."""
    a = _parser().parse_args(list(argv))
    _refuse_unsupported(a)
    nproc, visible = _local_devices(a)
    cmd = [sys.executable, "-m", "zkit.cli", "run", "--nproc", str(nproc)]
    if a.master_port is not None:
        cmd += ["--master-port", str(a.master_port)]
    if a.master_addr:
        cmd += ["--master-addr", a.master_addr]
    cmd += [str(Path(__file__).with_name("user_script.py")), a.user_script, *a.user_args]
    env = {"ZKIT_DEEPSPEED_LOCAL_RANK_ARG": "0" if a.no_local_rank else "1",
           "ZKIT_DEEPSPEED_MODULE": "1" if a.module else "0"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return cmd, env


def main(argv: Sequence[str] | None = None) -> int:
    import subprocess

    cmd, env = command(sys.argv[1:] if argv is None else argv)
    return subprocess.call(cmd, env={**os.environ, **env})


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
