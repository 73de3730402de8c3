"""Shared by the offload benchmarks: a hard memory cap for one child process: a cgroup of its own (v2 ``memory.max`` or v1
``memory.limit_in_bytes``) created under the current process's cgroup, entered by the child before
it executes anything, removed afterwards. The kernel kills the child (OOM inside the cgroup) when
it needs more than the cap, so an attempt that does not fit ends without pushing the rest of the
machine into swap. The cgroup's own peak (``memory.peak`` / ``memory.max_usage_in_bytes``) counts
anonymous memory plus page cache the child caused; swap files written with O_DIRECT add no cache.
"""
from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any


def _own_cgroup() -> tuple[str, Path] | None:
    """``("v2" | "v1", directory)`` of a writable memory cgroup this process may create children in."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hier, controllers, path = line.split(":", 2)
        if hier == "0" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            if "memory" in (base / "cgroup.controllers").read_text().split() and os.access(base, os.W_OK):
                return "v2", base
        if "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if base.is_dir() and os.access(base, os.W_OK):
                return "v1", base
    return None


class CappedRun:
    """Run ``cmd`` in a fresh memory cgroup limited to ``cap_bytes``.

    ``result()`` after the run: return code, whether the cgroup's OOM killer fired, its peak bytes.
    """

    def __init__(self, cap_bytes: int) -> None:
        found = _own_cgroup()
        if found is None:
            raise RuntimeError("no writable memory cgroup (v1 or v2) here: run as root on Linux, or give the "
                               "benchmark a machine where /sys/fs/cgroup is writable")
        self.version, base = found
        self.dir = base / f"zkit-bench-{uuid.uuid4().hex[:8]}"
        self.dir.mkdir()
        if self.version == "v2":
            (self.dir / "memory.max").write_text(str(cap_bytes))
            (self.dir / "memory.swap.max").write_text("0")
        else:
            (self.dir / "memory.limit_in_bytes").write_text(str(cap_bytes))
            swap_limit = self.dir / "memory.memsw.limit_in_bytes"
            if swap_limit.exists():
                swap_limit.write_text(str(cap_bytes))

    def run(self, cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        procs = self.dir / "cgroup.procs"

        def enter() -> None:  # in the child, before exec: everything it runs is capped
            procs.write_text(str(os.getpid()))

        try:
            return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, preexec_fn=enter)
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
            return subprocess.CompletedProcess(cmd, -9, out, f"timed out after {timeout:.0f} s")

    def peak_bytes(self) -> int:
        name = "memory.peak" if self.version == "v2" else "memory.max_usage_in_bytes"
        path = self.dir / name
        return int(path.read_text()) if path.exists() else 0

    def oom_killed(self) -> bool:
        if self.version == "v2":
            events = dict(line.split() for line in (self.dir / "memory.events").read_text().splitlines())
            return int(events.get("oom_kill", 0)) > 0
        control = dict(line.split() for line in (self.dir / "memory.oom_control").read_text().splitlines())
        return int(control.get("oom_kill", 0)) > 0

    def close(self) -> None:
        for _ in range(50):  # the cgroup can be removed once its last process has been reaped
            try:
                self.dir.rmdir()
                return
            except OSError:
                time.sleep(0.1)

    def __enter__(self) -> "CappedRun":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def print_size_table(rows: list, columns: list[tuple[str, Any]]) -> None:
    """The scale benchmarks' table: per ``(contestant, layers, best attempt or None)`` the depth,
    parameters and size against ``torch``'s, then one cell per ``(header, cell(attempt))``."""
    base = next((b["params"] for v, _, b in rows if v == "torch" and b), None)
    headers = ["contestant", "layers", "params", "x torch", *(h for h, _ in columns)]
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for v, layers, b in rows:
        if b is None:
            print(f"| {v} | - | none fits |" + " |" * (len(headers) - 3))
            continue
        ratio = f"{b['params'] / base:.2f}" if base else "-"
        cells = [v, str(layers), f"{b['params'] / 1e6:.0f}M", ratio, *(cell(b) for _, cell in columns)]
        print("| " + " | ".join(cells) + " |")
