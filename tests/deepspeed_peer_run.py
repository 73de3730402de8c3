"""Train :class:`PeerNet` with the real DeepSpeed, save a checkpoint, and continue: the reference
for importing DeepSpeed checkpoints. Runs in DeepSpeed's interpreter (``.venv-peers``), not zkit's:

    DS_ACCELERATOR=cpu .venv-peers/bin/python tests/deepspeed_peer_run.py --out DIR --runs 1:fp32,2:fp32

For every run ``STAGE:DTYPE[:offload]`` it trains ``--before`` steps on ``--world`` gloo ranks,
saves ``DIR/<run>/`` with ``engine.save_checkpoint``, trains ``--after`` more steps and records
every step's loss averaged over the ranks (the global batch's mean loss). ``DIR/results.json``
maps each run to ``{"before": [...], "after": [...]}``; ``DIR/<run>.zero_to_fp32.pt`` is the
state dict DeepSpeed's ``zero_to_fp32`` consolidates from the checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def join(rank: int, world: int, port: int) -> None:
    """Join the spawned ranks' gloo process group, one thread each, DeepSpeed on the CPU."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    join(rank, world, port)
    import deepspeed
    import torch

    from deepspeed_peer_model import PeerNet, batch, ds_config

    results = {}
    for run in args.runs.split(","):
        stage, dtype, *rest = run.split(":")
        if dtype == "fp16":  # DeepSpeed's CPU accelerator refuses fp16 unless oneDNN runs it natively;
            # torch computes it anyway (more slowly), which is all a checkpoint to import needs
            from deepspeed.accelerator import get_accelerator

            get_accelerator().is_fp16_supported = lambda: True
        model = PeerNet()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(int(stage), world, dtype, offload="offload" in rest),
                                          dist_init_required=False)
        dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
        name = run.replace(":", "-")

        def consolidate_and_scale(engine) -> dict:
            if rank == 0:  # DeepSpeed's own consolidation, for comparison
                from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

                state = get_fp32_state_dict_from_zero_checkpoint(os.path.join(args.out, name))
                torch.save({k: v.clone() for k, v in state.items()}, os.path.join(args.out, f"{name}.zero_to_fp32.pt"))
            return {"loss_scale": float(engine.optimizer.loss_scale) if dtype == "fp16" else 1.0}

        results[name] = train_save_continue(
            engine, lambda k: tuple(t.to(dt) for t in batch(k, rank, world)), name, args, world,
            client_state={"epoch": 3, "note": "peer"}, after_save=consolidate_and_scale)
        engine.destroy()
        del engine
    finish(results, os.path.join(args.out, "results.json"), rank)


def train_save_continue(engine, batch_of, name: str, args: argparse.Namespace, world: int,
                        client_state: dict | None = None, after_save=None) -> dict:
    """Train ``args.before`` steps, save ``args.out/name``, train ``args.after`` more; every step's
    loss averaged over the ranks. ``after_save(engine)`` may add entries to the result."""
    import torch.distributed as dist

    def step(k: int) -> float:
        loss = engine(*batch_of(k))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        return mean.item() / world

    before = [step(k) for k in range(args.before)]
    engine.save_checkpoint(os.path.join(args.out, name), client_state=client_state or {})
    extra = after_save(engine) if after_save is not None else {}
    dist.barrier()
    after = [step(k) for k in range(args.before, args.before + args.after)]
    return {"before": before, "after": after, **extra}


def finish(results: dict, path: str, rank: int) -> None:
    """Write ``results`` (rank 0) and leave every rank together."""
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        with open(path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown, where gloo's threads sometimes abort the process
    # ("terminate called without an active exception") after all the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def parse_args(runs: str, world: int, extra=None) -> argparse.Namespace:
    """The command line both DeepSpeed peer scripts take (``extra`` adds options)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", default=runs)
    parser.add_argument("--world", type=int, default=world)
    parser.add_argument("--before", type=int, default=3)
    parser.add_argument("--after", type=int, default=3)
    if extra is not None:
        extra(parser)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    return args


def launch(rank_fn, args: argparse.Namespace) -> None:
    """Run ``rank_fn(rank, world, port, args)`` on ``args.world`` spawned ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import torch.multiprocessing as mp

    mp.start_processes(rank_fn, args=(args.world, port, args), nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    launch(_rank, parse_args("1:fp32,2:fp32,3:fp32", 2))
