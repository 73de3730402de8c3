"""The small GPT on 4 ranks in two 3D layouts - 2 pipeline stages x 2 data-parallel replicas
(ZeRO-1, 1F1B, tied embedding) and 2 tensor-parallel ranks x 2 replicas (ZeRO-2) - trained through
``zkit.initialize`` with gradient clipping, next to the same model trained densely in one process
on the same global batches. Prints the loss curves (replica 0's share of each batch; the pipeline's ``train_batch`` returns the
replicas' mean, compared with the dense mean) and the
global gradient norms side by side.

    python contrib/bench/bench_pipeline_3d.py [--steps 20]
"""
from __future__ import annotations

import argparse
import os
import time

from zkit_pipeline.gpt_runs import make_data, train_dense, train_pipeline, train_tensor_parallel
from zkit_pipeline.tp_gpt import TensorParallelGPTConfig

CFG = TensorParallelGPTConfig(vocab_size=128, seq_len=32, d_model=64, n_heads=4, n_layers=4)
MICRO, BATCH, LR, CLIP = 4, 4, 3e-3, 1.0


def ranks(steps: int) -> dict:
    import logging

    import torch.distributed as dist

    logging.getLogger("zkit").addHandler(logging.NullHandler())  # the table below, not step lines

    data = make_data(CFG, steps, replicas=2, micro=MICRO, batch=BATCH, progressions=True)
    kw = {"lr": LR, "clip": CLIP}
    out = {}
    start = time.perf_counter()
    pipe = train_pipeline(CFG, data, stages=2, zero=1, **kw)
    out["pipe_s"] = time.perf_counter() - start
    out["pipe_replica"] = pipe.engine.module.grid.coord(dist.get_rank()).data
    pipe.engine.close()
    start = time.perf_counter()
    tensor = train_tensor_parallel(CFG, data, tensor=2, zero=2, **kw)
    out["tensor_s"] = time.perf_counter() - start
    out["tensor_replica"] = tensor.engine.module.coord.data
    tensor.engine.close()
    out.update(pipe=pipe.losses, pipe_norms=pipe.grad_norms, tensor=tensor.losses, tensor_norms=tensor.grad_norms)
    if dist.get_rank() == 0:
        dense = train_dense(CFG, data, **kw)
        out["dense"], out["dense_norms"] = dense.losses, dense.grad_norms
        # the pipeline engine's train_batch returns the replicas' mean, as DeepSpeed's does
        out["dense_mean"] = train_dense(CFG, data, replica=None, **kw).losses
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    from zkit.testing import run_ranks

    results = run_ranks(ranks, 4, args=(args.steps,), timeout=900)
    r0 = results[0]  # rank 0 is replica 0 in both layouts
    assert r0["pipe_replica"] == r0["tensor_replica"] == 0
    print(f"# 4 gloo ranks, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {CFG}")
    print(f"{'step':>4} {'dense':>9} {'2tp x 2dp':>10} {'dense mean':>10} {'2pipe x 2dp':>12}   {'norm dense':>10} {'pipe':>8} {'tensor':>8}")
    for i, dense in enumerate(r0["dense"]):
        print(f"{i + 1:>4} {dense:9.5f} {r0['tensor'][i]:10.5f} {r0['dense_mean'][i]:10.5f} {r0['pipe'][i]:12.5f}   "
              f"{r0['dense_norms'][i]:10.4f} {r0['pipe_norms'][i]:8.4f} {r0['tensor_norms'][i]:8.4f}")
    worst = max(abs(a - b) / abs(b) for k, ref in (("pipe", "dense_mean"), ("tensor", "dense"))
                for a, b in zip(r0[k], r0[ref]))
    print(f"largest relative loss difference from dense: {worst:.2e}; "
          f"time: pipe {r0['pipe_s']:.1f} s, tensor {r0['tensor_s']:.1f} s for {args.steps} steps")


if __name__ == "__main__":
    main()
