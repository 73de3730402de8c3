"""Which rank caused a failed job: what counts as a secondary error, and the summary ``zkit run`` prints.

When one rank dies, its peers fail inside a collective, or while gloo still connects the group,
with connection errors and timeouts of their own. One of those can be the failure torchrun observes
first (it stamps failures in whole seconds, and a rank that takes a while to exit is stamped late),
so the summary names as root cause the earliest failure that is not such a consequence, shows its
traceback, and lists the other ranks after it::

    ============================================================
    zkit run: 2 ranks on this node failed
    ------------------------------------------------------------
    Root cause: rank 1 (local_rank 1, pid 4242), exit code 1, at 2026-11-27 21:00:37
      Traceback (most recent call last):
        ...
      ValueError: shard 3 of the dataset is missing
    ------------------------------------------------------------
    Other ranks:
      rank 0 (local_rank 0, pid 4241), killed by SIGTERM, at 2026-11-27 21:00:36; follows from the root cause:
        RuntimeError: ... Timed out waiting 2000ms for recv operation to complete
    ============================================================

``zkit.testing.run_ranks`` orders its failure report by the same definition (:func:`is_secondary`).
"""
from __future__ import annotations

import datetime
import signal
from typing import Any, Mapping, Protocol

#: What a rank meets when a peer died or stalls: a consequence of another failure, never its cause.
SECONDARY_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting")

# How a failure ranks as the cause: an error of its own first, then a death without a traceback
# (a signal, an out-of-memory kill, ``sys.exit(1)``), then secondary errors, then ranks the
# launcher stopped (SIGTERM, no traceback) because another had failed.
_OWN, _NO_TRACEBACK, _SECONDARY, _STOPPED = range(4)
_RULE = 60


def is_secondary(text: str) -> bool:
    """Whether a rank's error text is one that follows from a peer's failure."""
    return any(marker in text for marker in SECONDARY_ERRORS)


class RankFailure(Protocol):
    """The fields of torchrun's ``ProcessFailure`` the summary reads."""

    local_rank: int
    pid: int
    exitcode: int
    message: Any  # torchrun's error-file record (a dict), or a line of its own
    error_file: str
    timestamp: int


def traceback_of(failure: RankFailure) -> str | None:
    """The traceback the rank recorded in its error file (``@record`` / zkit's excepthook), if any."""
    message = failure.message
    if isinstance(message, dict):
        text = message.get("extraInfo", {}).get("py_callstack") or message.get("message")
        return str(text).rstrip() if text else None
    if failure.error_file and failure.error_file != "<N/A>" and message:
        return str(message).rstrip()  # an error file written by something other than Python
    return None


def error_line(traceback: str) -> str:
    """The exception's own first line (``ValueError: ...``), after the traceback's frames."""
    lines = traceback.splitlines()
    start = 0
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            start = i + 1
    for line in lines[start:]:
        # Frames are "  File ..." with their source lines below, indented further.
        if line.strip() and not line.startswith(("  File ", "    ")):
            return line.strip()
    return lines[-1].strip() if lines else ""


def _kind(failure: RankFailure, traceback: str | None) -> int:
    if traceback is not None:
        return _SECONDARY if is_secondary(traceback) else _OWN
    return _STOPPED if failure.exitcode == -signal.SIGTERM else _NO_TRACEBACK


def _how(failure: RankFailure) -> str:
    if failure.exitcode < 0:
        try:
            return f"killed by {signal.Signals(-failure.exitcode).name}"
        except ValueError:
            return f"killed by signal {-failure.exitcode}"
    return f"exit code {failure.exitcode}"


def _header(rank: int, failure: RankFailure) -> str:
    when = datetime.datetime.fromtimestamp(failure.timestamp).strftime("%Y-%m-%d %H:%M:%S")
    return f"rank {rank} (local_rank {failure.local_rank}, pid {failure.pid}), {_how(failure)}, at {when}"


def _indented(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def _ordered(failures: Mapping[int, RankFailure]) -> tuple[list[int], dict[int, int], dict[int, str | None]]:
    if not failures:
        raise ValueError("a failed job has at least one failed rank")
    tracebacks = {rank: traceback_of(failure) for rank, failure in failures.items()}
    kinds = {rank: _kind(failure, tracebacks[rank]) for rank, failure in failures.items()}
    # Among possible causes the earliest; a traceback of its own breaks a tie of torchrun's seconds.
    order = sorted(failures, key=lambda r: (0, failures[r].timestamp, kinds[r], r) if kinds[r] < _SECONDARY
                   else (1, kinds[r], failures[r].timestamp, r))
    return order, kinds, tracebacks


def root_cause_rank(failures: Mapping[int, RankFailure]) -> int:
    """The rank whose failure the summary names first."""
    return _ordered(failures)[0][0]


def failure_summary(failures: Mapping[int, RankFailure]) -> str:
    """The root cause among ``failures`` (global rank -> failure) with its traceback, then the others."""
    order, kinds, tracebacks = _ordered(failures)
    first = order[0]
    lines = ["=" * _RULE, f"zkit run: {len(failures)} rank{'s' if len(failures) > 1 else ''} on this node failed",
             "-" * _RULE]
    if kinds[first] < _SECONDARY:
        lines.append(f"Root cause: {_header(first, failures[first])}")
        consequence = "follows from the root cause"
    else:
        lines.append("Root cause: none recorded here. Every failed rank failed with a connection error or timeout, "
                     "which follows from a peer that died or stalled (on another node, or one listed below as "
                     f"stopped); the earliest: {_header(first, failures[first])}")
        consequence = "follows from a peer's failure"
    lines.append(_indented(tracebacks[first] or "(no traceback recorded: see the rank's output above)", "  "))
    if len(order) > 1:
        lines += ["-" * _RULE, "Other ranks:"]
    for rank in order[1:]:
        kind, traceback = kinds[rank], tracebacks[rank]
        note = {_OWN: "failed as well", _NO_TRACEBACK: "recorded no traceback",
                _SECONDARY: consequence, _STOPPED: "stopped by the launcher"}[kind]
        lines.append(f"  {_header(rank, failures[rank])}; {note}" + (":" if traceback else ""))
        if traceback:
            lines.append(f"    {error_line(traceback)}")
    lines.append("=" * _RULE)
    return "\n".join(lines)
