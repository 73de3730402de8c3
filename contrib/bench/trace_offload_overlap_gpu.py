"""One GPU: stage-3 parameter offload's copies against compute in a profiler trace.

The scenario of ``tests/gpu/test_copies_gpu.py``'s overlap test (8 bf16 layers of 2048 x 2048,
``offload_param`` on pinned host memory, a prefetch window of 3 layers): prints the step time at
1024 rows, how many host-to-device copies overlap a compute kernel at ``OVERLAP_ROWS`` rows, how
many host synchronisations the copy queue made in that step, the first 60 device events and the
operators by CPU time; writes the Chrome trace to ``$OUT`` (default: the temporary directory)::

    PYTHONPATH=. python contrib/bench/trace_offload_overlap_gpu.py
"""
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "gpu"))
from test_copies_gpu import OVERLAP_ROWS, WIDTH, _engine, _kernels, _step  # noqa: E402

from zkit.zero.copy_queue import StreamCopy  # noqa: E402

out = os.environ.get("OUT", tempfile.gettempdir())
engine = _engine({"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                  "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 3 * WIDTH * WIDTH})
_step(engine)
torch.cuda.synchronize()
for _ in range(2):
    t0 = time.perf_counter()
    _step(engine)
    torch.cuda.synchronize()
    print("step s", time.perf_counter() - t0)
calls = {"sync": 0}
original = StreamCopy.synchronize


def counting(self):
    calls["sync"] += 1
    return original(self)


StreamCopy.synchronize = counting  # this script's own count of host waits
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
    _step(engine, rows=OVERLAP_ROWS)
    torch.cuda.synchronize()
print("host syncs of copies in one step:", calls)
copies, compute = _kernels(prof)
h2d = [c for c in copies if "HtoD" in c[0]]
print("h2d", len(h2d), "overlapping", sum(any(k[1] < c[2] and c[1] < k[2] for k in compute) for c in h2d))
prof.export_chrome_trace(os.path.join(out, "trace_stage3.json"))
events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
t0 = events[0].time_range.start if events else 0
for e in events[:60]:
    print(f"{e.time_range.start - t0:9.1f} {e.time_range.end - e.time_range.start:8.1f} dev{e.device_index} {e.name[:70]}")
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
engine.close()
