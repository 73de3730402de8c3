"""Failures that explain themselves: what each rank was doing when a collective of the torch
communicator failed.

Every collective a communicator issues gets a :class:`Fingerprint` (sequence number, op, shape,
dtype, group, and the *phase* of training that issued it: ``forward``, ``backward: reduce
'layers.3.mlp'``, ``optimizer.step``...). When a collective fails - its group's timeout
(``comms_timeout_s`` in the config, ``ZKIT_COMMS_TIMEOUT_S`` in the environment) expired, or a peer
died - the rank publishes its recent fingerprints in the job's key-value store, collects the other
ranks' for a few seconds, and raises :class:`CollectiveFailed` with a report naming which rank was
where and where they diverge, instead of hanging until NCCL's 30-minute default.
"""
from __future__ import annotations

import json
import os
import time
from collections import deque
from datetime import timedelta
from typing import Any

import attrs

from zkit.core.phases import current_phase

ENV_TIMEOUT = "ZKIT_COMMS_TIMEOUT_S"


class CollectiveFailed(RuntimeError):
    """A collective timed out or lost a peer; the message is the cross-rank report."""


@attrs.frozen
class Fingerprint:
    seq: int
    op: str
    shape: tuple[int, ...]
    dtype: str
    group: str
    phase: str

    def describe(self) -> str:
        shape = "x".join(map(str, self.shape)) if self.shape else "-"
        return f"#{self.seq} {self.op} {self.dtype}[{shape}] on group {self.group} in {self.phase}"


class FingerprintLog:
    """The last fingerprints of one communicator."""

    def __init__(self, group: str, keep: int = 8) -> None:
        self.group = group
        self.seq = 0
        self.recent: deque[Fingerprint] = deque(maxlen=keep)

    def record(self, op: str, tensor: Any = None) -> Fingerprint:
        self.seq += 1
        shape = tuple(tensor.shape) if tensor is not None and hasattr(tensor, "shape") else ()
        dtype = str(tensor.dtype).replace("torch.", "") if tensor is not None and hasattr(tensor, "dtype") else "object"
        fp = Fingerprint(self.seq, op, shape, dtype, self.group, current_phase())
        self.recent.append(fp)
        return fp


def timeout_seconds(config: Any) -> float | None:
    """The collective timeout: the environment wins over the config; None = torch's default."""
    env = os.environ.get(ENV_TIMEOUT)
    if env:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"{ENV_TIMEOUT} must be a number of seconds, got {env!r}") from None
        if value <= 0:
            raise ValueError(f"{ENV_TIMEOUT} must be > 0, got {env!r}")
        return value
    return getattr(config, "comms_timeout_s", None) if config is not None else None


def report(log: FingerprintLog, rank: int, world: list[int], error: BaseException, store: Any, grace_s: float = 5.0) -> str:
    """Publish this rank's fingerprints, gather the others' (waiting up to ``grace_s``), and
    describe where the ranks are."""
    mine = [attrs.asdict(fp) for fp in log.recent]
    prefix = f"zkit/collective-failure/{log.group}"
    others: dict[int, list[dict]] = {rank: mine}
    if store is not None:
        try:
            store.set(f"{prefix}/{rank}", json.dumps(mine))
            deadline = time.monotonic() + grace_s
            pending = [r for r in world if r != rank]
            while pending and time.monotonic() < deadline:
                for r in list(pending):
                    key = f"{prefix}/{r}"
                    if store.check([key]):
                        others[r] = json.loads(store.get(key))
                        pending.remove(r)
                time.sleep(0.1)
        except Exception:  # the store may be gone with a dead rank: report what we know
            pass
    lines = [f"collective failed on rank {rank}: {str(error).splitlines()[0] if str(error) else type(error).__name__}"]
    last: dict[int, dict] = {}
    for r in world:
        fps = others.get(r)
        if not fps:
            lines.append(f"  rank {r}: no report (not inside a collective, stuck in computation, or dead)")
            continue
        last[r] = fps[-1]
        lines.append(f"  rank {r}: at {Fingerprint(**{**fps[-1], 'shape': tuple(fps[-1]['shape'])}).describe()}")
    if len(last) > 1:
        keys = {r: (fp["seq"], fp["op"], tuple(fp["shape"]), fp["phase"]) for r, fp in last.items()}
        if len(set(keys.values())) > 1:
            base_rank = min(keys)
            for r, key in sorted(keys.items()):
                if key != keys[base_rank]:
                    lines.append(
                        f"  diverged: rank {r} is in {last[r]['phase']!r} ({last[r]['op']} #{last[r]['seq']}) while "
                        f"rank {base_rank} is in {last[base_rank]['phase']!r} ({last[base_rank]['op']} #{last[base_rank]['seq']})"
                    )
                    break
        else:
            lines.append("  all reporting ranks are at the same collective: a rank without a report is the one missing")
    return "\n".join(lines)


def as_timedelta(seconds: float | None) -> timedelta | None:
    return timedelta(seconds=seconds) if seconds else None
