"""The DeepSpeed side of the fuzzer's ``ds_import`` feature. Runs in DeepSpeed's interpreter
(``.venv-peers``), not zkit's:

    DS_ACCELERATOR=cpu .venv-peers/bin/python tests/composition_fuzz_peer.py --out DIR --runs JSON

``JSON`` is a list of ``[features, stage]``: for each, the real DeepSpeed trains the composition
model of ``features`` (their numerics and model features: the matrix's model, tied weights, the
WarmupLR schedule) for the first 2 of the runs' 3 steps at ZeRO ``stage`` on 2 gloo ranks, on the
same global batches as zkit's runs, and saves ``DIR/<run_name(features, stage)>`` with
``engine.save_checkpoint``.
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # zkit's GPT blocks: plain torch modules

STEPS_BEFORE = 2


def run_name(features, stage: int) -> str:
    return f"ds{stage}-" + "-".join(features)


def ds_config(features, stage: int) -> dict:
    """DeepSpeed's config of the run: the zkit reference's numbers (AdamW as torch computes it, no
    clipping: DeepSpeed's default is 1.0)."""
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "steps_per_print": 1_000_000,
    }
    if "scheduler" in features:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 4, "warmup_type": "linear"}}
    return cfg


def _rank(rank: int, world: int, port: int, args) -> None:
    from deepspeed_peer_run import join

    join(rank, world, port)
    import deepspeed
    import torch
    import torch.distributed as dist

    from composition_models import Net, batch, loss

    for features, stage in json.loads(args.runs):
        model = Net(tuple(features))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(features, stage), dist_init_required=False)
        for step in range(STEPS_BEFORE):
            x, y = batch(step, tuple(features))
            xs, ys = x[2 * rank: 2 * rank + 2], y[2 * rank: 2 * rank + 2]
            engine.backward(loss(engine(xs), ys))
            engine.step()
        engine.save_checkpoint(os.path.join(args.out, run_name(features, stage)))
        engine.destroy()
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads sometimes abort the interpreter's teardown


if __name__ == "__main__":
    from deepspeed_peer_run import launch, parse_args

    launch(_rank, parse_args("[]", 2))
