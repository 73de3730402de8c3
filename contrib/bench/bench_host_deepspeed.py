"""``bench_host.py``'s DeepSpeed contestants, run in DeepSpeed's own interpreter (started by
``bench_host.py`` through :func:`zero_deepspeed_side.deepspeed_command`): the same model, config
and counts as zkit's, one contestant after another on ``--world`` gloo ranks; one JSON line out.

``ds-N`` is ZeRO stage N with torch's fused AdamW as the client optimizer (as
``zero_deepspeed_side.py`` gives it); ``ds-2-offload`` and ``ds-3-offload`` take the config's
AdamW, which DeepSpeed steps with its ``DeepSpeedCPUAdam`` on the host."""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _build(name: str, shape: dict[str, int], micro_batch: int, dtype: str) -> tuple[Any, Any, Any]:
    import deepspeed
    import torch

    from bench_gpu_contestants import zkit_config
    from bench_gpu_model import PlainGPT, Shape
    from bench_host_contestants import optimizer_tensors
    from zero_workloads import ADAMW
    from zkit.step_counts import storages_of

    cfg = zkit_config("zkit-" + name.split("-", 1)[1], micro_batch, dtype, None)
    offload = name.endswith("-offload")
    client = None
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg, enabled=cfg["zero_optimization"]["stage"] == 3):
        model = PlainGPT(Shape(**shape))
    if not offload:
        cfg.pop("optimizer")
        client = torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)
    engine, optimizer, *_ = deepspeed.initialize(model=model, optimizer=client, model_parameters=model.parameters(),
                                                 config=cfg, dist_init_required=False)

    def step(ids: Any) -> Any:
        loss = engine(ids, ids)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    resident = None
    if offload:
        inner = getattr(optimizer, "optimizer", optimizer)  # DeepSpeedCPUAdam under the ZeRO wrapper
        resident = storages_of(lambda: optimizer_tensors(inner) + [
            t for group in getattr(optimizer, "single_partition_of_fp32_groups", []) for t in [group, group.grad]
            if t is not None])
    return engine, step, resident


def ranks(names: list[str], shape: dict[str, int], micro_batch: int, dtype: str, warmup: int,
          steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from bench_gpu_model import Shape
    from bench_host import batches_for, measure

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in names:
        engine = None
        try:
            engine, step, resident = _build(name, shape, micro_batch, dtype)
            batches = batches_for(Shape(**shape), micro_batch, warmup + 1 + steps, dist.get_rank())
            out[name] = measure(step, batches, warmup, steps, resident)
        except Exception as exc:  # noqa: BLE001 - a failing contestant is a table entry
            if dist.get_rank() == 0:
                traceback.print_exc()
            out[name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
            dist.barrier()
        finally:
            if engine is not None and hasattr(engine, "destroy"):
                engine.destroy()
            engine = step = None
            gc.collect()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--names", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--shape", required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    sys.path[:0] = [HERE, REPO]
    import bench_host_deepspeed  # by its module name: the ranks find the function
    from bench_host import RESULT
    from zkit.testing import run_ranks

    names = [n for n in args.names.split(",") if n]
    results = run_ranks(bench_host_deepspeed.ranks, args.world, args=(names, json.loads(args.shape), args.micro_batch, args.dtype,
                                                 args.warmup, args.steps), timeout=args.timeout * len(names))
    print(RESULT + json.dumps(results[0]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
