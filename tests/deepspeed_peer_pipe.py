"""Train :func:`pipe_layers` as a DeepSpeed ``PipelineModule`` with the real DeepSpeed, save, and
continue: the reference for importing DeepSpeed pipeline checkpoints. Runs in DeepSpeed's
interpreter (``.venv-peers``):

    DS_ACCELERATOR=cpu .venv-peers/bin/python tests/deepspeed_peer_pipe.py --out DIR --world 4 --stages 2 --runs 1:fp32

Every run ``ZERO_STAGE:DTYPE`` trains ``--before`` steps on ``--world`` gloo ranks split into
``--stages`` pipeline stages, saves ``DIR/pipe-<run>/``, trains ``--after`` more steps and records
every step's loss (the global batch's mean) in ``DIR/results.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    from deepspeed_peer_run import join

    join(rank, world, port)
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed import pipe

    deepspeed.init_distributed(dist_backend="gloo")  # PipelineModule asks DeepSpeed's comm for ranks

    from deepspeed_peer_model import pipe_batches, pipe_config, pipe_layers, pipe_loss

    dp_world = world // args.stages
    results = {}
    for run in args.runs.split(","):
        stage, dtype = run.split(":")
        model = pipe.PipelineModule(layers=pipe_layers(pipe), num_stages=args.stages, loss_fn=pipe_loss,
                                    partition_method="uniform")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()],
                                          config=pipe_config(int(stage), dp_world, dtype))
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]

        def step(k: int) -> float:
            micro = [(x.to(dt), y.to(dt)) for x, y in pipe_batches(k, engine.grid.data_parallel_id, dp_world)]
            return float(engine.train_batch(iter(micro)))

        before = [step(k) for k in range(args.before)]
        name = "pipe-" + run.replace(":", "-")
        engine.save_checkpoint(os.path.join(args.out, name), client_state={"epoch": 3, "note": "peer"})
        dist.barrier()
        after = [step(k) for k in range(args.before, args.before + args.after)]
        results[name] = {"before": before, "after": after}
        del engine
    dist.barrier()
    if rank == 0:
        with open(os.path.join(args.out, "pipe-results.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # without the interpreter's teardown, where gloo's threads sometimes abort


if __name__ == "__main__":
    from deepspeed_peer_run import launch, parse_args

    launch(_rank, parse_args("1:fp32", 4, lambda p: p.add_argument("--stages", type=int, default=2)))
