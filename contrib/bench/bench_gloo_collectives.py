"""Why zkit's torch communicator runs all-gather and reduce-scatter on gloo as one broadcast /
one reduce per rank: side by side with torch's flat collectives, same bytes on the wire.

    OMP_NUM_THREADS=1 python contrib/bench/bench_gloo_collectives.py --worlds 2 4 --numel 5e6 23e6

Prints, per world size and tensor size, the median time of each form (fp32, 5 repetitions after a
barrier each) and the ratio of torch's flat collective to the per-rank form.

``--engine`` instead times what the choice gives a user: a stage-3 step of the ``medium`` GPT
(micro-batch 4 x 128) with the communicator's own choice (per rank, gloo's own reduce-scatter for
small units from 4 ranks up) against every collective per rank, rounds interleaved::

    OMP_NUM_THREADS=1 python contrib/bench/bench_gloo_collectives.py --engine --worlds 4 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))


def measure(numel: int, reps: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    shard = numel // world
    buf = torch.randn(shard * world)
    chunks = buf.view(world, -1)

    def all_gather_flat():
        dist.all_gather_into_tensor(buf, chunks[rank])

    def all_gather_broadcasts():
        for w in [dist.broadcast(chunks[k], src=k, async_op=True) for k in range(world)]:
            w.wait()

    def reduce_scatter_flat():
        dist.reduce_scatter_tensor(chunks[rank], buf)

    def reduce_scatter_reduces():
        for w in [dist.reduce(chunks[k], dst=k, async_op=True) for k in range(world)]:
            w.wait()

    def all_reduce():
        dist.all_reduce(buf)

    out = {}
    for name, fn in [("all_reduce", all_reduce), ("all_gather flat", all_gather_flat),
                     ("all_gather broadcasts", all_gather_broadcasts), ("reduce_scatter flat", reduce_scatter_flat),
                     ("reduce_scatter reduces", reduce_scatter_reduces)]:
        times = []
        for _ in range(reps + 1):
            dist.barrier()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        out[name] = sorted(times[1:])[len(times[1:]) // 2]
    return out


def engine_steps(forced: str | None, steps: int) -> list[float]:
    """One rank: stage-3 step times of the medium GPT, the communicator's flat collectives
    ``forced`` (None: its own choice), built through ``zkit.Stack``."""
    import torch
    import torch.distributed as dist

    import zkit
    from zkit.torch_distributed.communicator import TorchCommunicator
    from zkit.core.records import CommunicatorRecord

    sys.path.insert(0, HERE)
    from zero_torch_side import build_zkit
    from zero_workloads import Workload, batches

    torch.set_num_threads(1)
    record = CommunicatorRecord(name=f"torch-{forced}", factory=lambda group, config: TorchCommunicator(
        group, config, flat_collectives=forced), description="torch.distributed, flat collectives forced (benchmark)")
    w = Workload(preset="medium", seq_len=128, micro_batch=4, dtype="fp32", bucket_numel=5_000_000)
    engine = build_zkit(w, "zkit ZeRO-3", zkit.Stack(communicator=record))
    times = []
    for b in batches(w, dist.get_rank(), steps + 1):
        dist.barrier()
        t = time.perf_counter()
        engine.backward(engine(b, b))
        engine.step()
        times.append(time.perf_counter() - t)
    engine.close()
    return times[1:]


def engine_main(worlds: list[int], rounds: int, steps: int) -> None:
    import statistics

    from zkit.testing import run_ranks

    for world in worlds:
        runs: dict[str, list[float]] = {"own choice": [], "per_rank": []}
        for _ in range(rounds):
            for name in runs:
                per_rank = run_ranks(engine_steps, world, args=(None if name == "own choice" else name, steps), timeout=900)
                runs[name] += [max(ts) for ts in zip(*per_rank)]  # the slowest rank's step
        own, forced = (statistics.median(runs[k]) for k in runs)
        print(f"{world} ranks, stage 3, medium GPT, micro-batch 4 x 128: the communicator's own choice "
              f"{own:.3f} s, every collective per rank {forced:.3f} s ({own / forced:.3f}x); median of "
              f"{len(runs['per_rank'])} steps each; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def main() -> None:
    from zkit.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--numel", type=float, nargs="+", default=[5e6, 23e6])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--engine", action="store_true", help="time stage-3 steps instead (see above)")
    ap.add_argument("--rounds", type=int, default=3, help="--engine: interleaved rounds")
    ap.add_argument("--steps", type=int, default=4, help="--engine: timed steps per round")
    ns = ap.parse_args()
    if ns.engine:
        engine_main(ns.worlds, ns.rounds, ns.steps)
        return
    print("| ranks | elements | all_reduce ms | all_gather flat / broadcasts ms | ratio | "
          "reduce_scatter flat / reduces ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    for world in ns.worlds:
        for numel in ns.numel:
            t = run_ranks(measure, world, args=(int(numel), ns.reps), timeout=600)[0]
            ms = {k: v * 1000 for k, v in t.items()}
            print(f"| {world} | {int(numel):,} | {ms['all_reduce']:.1f} | "
                  f"{ms['all_gather flat']:.1f} / {ms['all_gather broadcasts']:.1f} | "
                  f"{ms['all_gather flat'] / ms['all_gather broadcasts']:.2f} | "
                  f"{ms['reduce_scatter flat']:.1f} / {ms['reduce_scatter reduces']:.1f} | "
                  f"{ms['reduce_scatter flat'] / ms['reduce_scatter reduces']:.2f} |", flush=True)
    print(f"gloo on 127.0.0.1, fp32, median of {ns.reps}; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}, {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
