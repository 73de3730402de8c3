"""The bound of an offloaded step, measured on the machine the benchmark runs on.

An offloaded step cannot take less than the largest of three times, each measured alone here:

* **compute**: forward and backward of the model on the device, in the training dtype, no
  optimizer (the step's device work when nothing waits for the host);
* **transfers**: the bytes the step must move between host and device, over the pinned-copy
  bandwidth measured now; the link is full duplex, so the larger of the two directions counts;
* **host optimizer**: zkit-offload's CPU AdamW step over all parameters in fp32, alone.

The bytes a step must move, with Ψ parameters in 2-byte (bf16) form, per contestant:

* ``zkit-2-offload`` (ZeRO-Offload): the gradients to the host (2Ψ), the updated parameters back (2Ψ);
* ``zkit-3-offload``: the parameters to the device in forward and again in backward (4Ψ), the
  gradients to the host (2Ψ); the updated parameters stay on the host, where their shards live.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from bench_gpu_model import PlainGPT, Shape

#: contestant -> (host-to-device, device-to-host) bytes per parameter per step
TRANSFER_BYTES = {"zkit-2-offload": (2, 2), "zkit-3-offload": (4, 2)}


def _median_time(fn: Callable[[], Any], repeat: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def compute_seconds(shape: Shape, micro_batch: int, dtype: str, device: torch.device, repeat: int) -> float:
    """Forward and backward alone, the model entirely in the training dtype."""
    torch.manual_seed(0)
    model = PlainGPT(shape).to(device=device, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    ids = torch.randint(0, shape.vocab, (micro_batch, shape.seq), device=device)

    def fwd_bwd() -> None:
        model(ids, ids).backward()
        for p in model.parameters():
            p.grad = None

    return _median_time(fwd_bwd, repeat, _sync(device))


def pinned_bandwidth(nbytes: int, repeat: int) -> tuple[float, float]:
    """Bytes per second host-to-device and device-to-host, pinned host memory, one copy at a time."""
    host = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    sync = _sync(torch.device("cuda"))
    h2d = _median_time(lambda: dev.copy_(host, non_blocking=True), repeat, sync)
    d2h = _median_time(lambda: host.copy_(dev, non_blocking=True), repeat, sync)
    return nbytes / h2d, nbytes / d2h


def host_optimizer_seconds(numel: int, repeat: int) -> float:
    """zkit-offload's CPU AdamW step over ``numel`` fp32 parameters, alone."""
    from zkit_offload import CPUAdamW

    from zero_workloads import ADAMW

    p = torch.nn.Parameter(torch.randn(numel, device="cpu") * 0.02)
    p.grad = torch.randn(numel, device="cpu") * 1e-3
    opt = CPUAdamW([p], **ADAMW)
    return _median_time(opt.step, repeat, lambda: None)


def measure(shape: Shape, micro_batch: int, dtype: str, device: torch.device, repeat: int) -> dict[str, Any]:
    """Every part of the bound that this machine has: without a device, no transfers."""
    out: dict[str, Any] = {"params": shape.parameters(),
                           "compute_s": compute_seconds(shape, micro_batch, dtype, device, repeat),
                           "host_opt_s": host_optimizer_seconds(shape.parameters(), repeat)}
    if device.type == "cuda":
        out["h2d_Bps"], out["d2h_Bps"] = pinned_bandwidth(256 * 2**20, repeat)
    return out


def bound_of(name: str, parts: dict[str, Any]) -> dict[str, float] | None:
    """``{"compute_s", "transfer_s", "host_opt_s", "bound_s"}`` of offloaded contestant ``name``
    (``transfer_s`` is 0 without a device: nothing crosses), or None for one without a bound."""
    if name not in TRANSFER_BYTES:
        return None
    h2d, d2h = TRANSFER_BYTES[name]
    transfer = 0.0
    if "h2d_Bps" in parts:
        transfer = max(h2d * parts["params"] / parts["h2d_Bps"], d2h * parts["params"] / parts["d2h_Bps"])
    out = {"compute_s": parts["compute_s"], "transfer_s": transfer, "host_opt_s": parts["host_opt_s"]}
    out["bound_s"] = max(out.values())
    return out


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
