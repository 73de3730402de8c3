"""A terminal progress bar without dependencies.

On a terminal it redraws one line in place::

    train  45%|█████████▏          | 90/200 [00:42<00:51, 2.13 it/s, loss=2.41]

When its stream is not a terminal (CI logs, files) it prints a plain line every ``plain_interval_s``
seconds and at the end instead, so a log holds a readable history rather than carriage returns::

    train 90/200 (45%) | 2.13 it/s | elapsed 0:42 | eta 0:51 | loss=2.41

Other output should go through :func:`write_line` (or :meth:`ProgressBar.write`), which clears a live
bar, prints the line and redraws the bar below it.
"""
from __future__ import annotations

import logging
import shutil
import sys
import time
from typing import Any, Callable, TextIO

_BLOCKS = " ▏▎▍▌▋▊▉█"
_active: list[ProgressBar] = []


def _clock_text(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def _postfix_text(postfix: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in postfix.items())


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class ProgressBar:
    """Progress of ``total`` units of work (steps).

    Args:
        total: units expected (``None`` or 0: unknown, no percentage or ETA).
        desc: a short label printed first.
        enabled: ``False`` makes every method a no-op (e.g. on ranks other than 0).
        file: the stream (``sys.stderr`` by default).
        interval_s: least time between redraws on a terminal.
        plain_interval_s: time between plain lines when ``file`` is not a terminal.
        clock: seconds as a float (injectable for tests).
    """

    def __init__(
        self,
        total: int | None,
        desc: str = "",
        enabled: bool = True,
        file: TextIO | None = None,
        interval_s: float = 0.1,
        plain_interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if total is not None and total < 0:
            raise ValueError(f"ProgressBar total must be >= 0 or None, got {total}")
        self.total = total or None
        self.desc = desc
        self.enabled = enabled
        self.file = file if file is not None else sys.stderr
        self.tty = _is_tty(self.file)
        self.interval_s = interval_s
        self.plain_interval_s = plain_interval_s
        self._clock = clock
        self.n = 0
        self.postfix: dict[str, Any] = {}
        self._start = clock()
        self._last_print = self._start
        self._closed = False
        if enabled:
            _active.append(self)
            if self.tty:
                self._draw()

    # -- state --------------------------------------------------------------------------------
    def update(self, n: int = 1, **postfix: Any) -> None:
        """Advance by ``n`` units, replacing the named postfix fields (``loss=2.41``)."""
        if not self.enabled or self._closed:
            return
        self.n += n
        self.postfix.update(postfix)
        now = self._clock()
        wait = self.interval_s if self.tty else self.plain_interval_s
        if now - self._last_print >= wait:
            self._last_print = now
            if self.tty:
                self._draw()
            else:
                self._print_plain()

    def set_postfix(self, **postfix: Any) -> None:
        """Replace the named postfix fields without advancing."""
        self.postfix.update(postfix)

    @property
    def rate(self) -> float:
        """Units per second since the bar started."""
        elapsed = self._clock() - self._start
        return self.n / elapsed if elapsed > 0 else 0.0

    def eta_s(self) -> float | None:
        rate = self.rate
        if self.total is None or rate <= 0:
            return None
        return max(0, self.total - self.n) / rate

    # -- rendering ----------------------------------------------------------------------------
    def render(self, width: int | None = None) -> str:
        """The terminal form of the bar, at most ``width`` columns."""
        width = width or shutil.get_terminal_size((100, 20)).columns
        elapsed = _clock_text(self._clock() - self._start)
        eta = self.eta_s()
        stats = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        stats += f" [{elapsed}<{_clock_text(eta) if eta is not None else '?'}, {self.rate:.2f} it/s"
        stats += f", {_postfix_text(self.postfix)}]" if self.postfix else "]"
        prefix = f"{self.desc} " if self.desc else ""
        if not self.total:
            return (prefix + stats)[:width]
        frac = min(1.0, self.n / self.total)
        prefix += f"{frac * 100:3.0f}%|"
        bar_width = max(1, min(40, width - len(prefix) - len(stats) - 2))
        filled = frac * bar_width
        full = int(filled)
        bar = "█" * full
        if full < bar_width:
            bar += _BLOCKS[int((filled - full) * (len(_BLOCKS) - 1))] + " " * (bar_width - full - 1)
        return f"{prefix}{bar}| {stats}"[:width]

    def plain_line(self) -> str:
        """The non-terminal form: one self-contained line."""
        parts = [f"{self.desc} " if self.desc else ""]
        if self.total:
            parts[0] += f"{self.n}/{self.total} ({self.n / self.total * 100:.0f}%)"
        else:
            parts[0] += f"{self.n}"
        parts.append(f"{self.rate:.2f} it/s")
        parts.append(f"elapsed {_clock_text(self._clock() - self._start)}")
        eta = self.eta_s()
        if eta is not None:
            parts.append(f"eta {_clock_text(eta)}")
        if self.postfix:
            parts.append(_postfix_text(self.postfix))
        return " | ".join(parts)

    def _draw(self) -> None:
        self.file.write("\r\x1b[K" + self.render())
        self.file.flush()

    def _print_plain(self) -> None:
        self.file.write(self.plain_line() + "\n")
        self.file.flush()

    def write(self, line: str) -> None:
        """Print ``line`` on this bar's stream without breaking the bar."""
        write_line(line, self.file)

    def close(self) -> None:
        """Print the final state and stop (safe to call twice)."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        if self in _active:
            _active.remove(self)
        if self.tty:
            self._draw()
            self.file.write("\n")
        else:
            self._print_plain()
        self.file.flush()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def write_line(line: str, file: TextIO | None = None) -> None:
    """Print ``line`` to ``file`` (stderr by default). When progress bars are live on a terminal they
    are cleared first and redrawn below the line, so log lines and bars do not mix."""
    stream = file if file is not None else sys.stderr
    bars = [bar for bar in _active if bar.tty] if _is_tty(stream) else []
    for bar in bars:
        bar.file.write("\r\x1b[K")
        bar.file.flush()
    stream.write(line + "\n")
    stream.flush()
    for bar in bars:
        bar._draw()


class ProgressBarLogHandler(logging.StreamHandler):
    """A logging handler whose records are printed with :func:`write_line`, above any live bar::

        logging.getLogger("zkit").addHandler(ProgressBarLogHandler())
    """

    def emit(self, record: logging.LogRecord) -> None:
        try:
            write_line(self.format(record), self.stream)
        except Exception:  # logging must never raise into training
            self.handleError(record)
