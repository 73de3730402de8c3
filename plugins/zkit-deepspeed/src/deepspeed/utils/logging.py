"""``deepspeed.utils.logging``: DeepSpeed's logger and rank-filtered logging, with DeepSpeed's names.

``logger`` is zkit's logger (``logging.getLogger("zkit")``), the one the engine writes its step
lines to, so a library that quiets "DeepSpeed" (Lightning's
``deepspeed.utils.logging.logger.setLevel(...)``) quiets the engine it runs. ``log_dist`` and
``print_dist`` follow DeepSpeed's rule: outside a process group every call logs; inside one, only
when ``ranks`` holds this rank or starts with -1 (``ranks=None`` logs nowhere).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import sys
from typing import Any

__all__ = ["LoggerFactory", "get_current_level", "get_dist_msg", "get_log_level_from_string", "log_dist",
           "log_dist_once", "log_levels", "logger", "print_configuration", "print_dist", "print_json_dist",
           "set_log_level_from_string", "should_log_le", "warning_once"]

log_levels: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


class LoggerFactory:
    """``LoggerFactory.create_logger(name, level)``: a logger that writes to stdout in DeepSpeed's
    format and does not pass its records on to the root logger."""

    @staticmethod
    def create_logger(name: str | None = None, level: int = logging.WARNING) -> logging.Logger:
        if name is None:
            raise ValueError("name for logger cannot be None")
        formatter = logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s")
        created = logging.getLogger(name)
        created.setLevel(level)
        created.propagate = False
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setLevel(level)
        handler.setFormatter(formatter)
        created.addHandler(handler)
        return created


#: zkit's logger under DeepSpeed's name (see the module docstring)
logger = logging.getLogger("zkit")


@functools.lru_cache(None)
def warning_once(*args: Any, **kwargs: Any) -> None:
    """``logger.warning`` that emits a given message once per process."""
    logger.warning(*args, **kwargs)


def get_dist_msg(message: str, ranks: list[int] | None = None) -> str | None:
    """``[Rank r] message`` when this rank should log it (see the module docstring), else None."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return f"[Rank -1] {message}"
    rank = dist.get_rank()
    ranks = ranks or []
    if ranks and (ranks[0] == -1 or rank in set(ranks)):
        return f"[Rank {rank}] {message}"
    return None


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    text = get_dist_msg(message, ranks)
    if text is not None:
        logger.log(level, text)


def print_dist(message: str, ranks: list[int] | None = None) -> None:
    """As :func:`log_dist`, printed whatever the log level."""
    text = get_dist_msg(message, ranks)
    if text is not None:
        print(text)


@functools.lru_cache(None)
def _log_dist_once(message: str, ranks: tuple[int, ...] | None, level: int) -> None:
    log_dist(message, ranks=list(ranks) if ranks is not None else None, level=level)


def log_dist_once(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """:func:`log_dist` that emits a given message once per process."""
    _log_dist_once(message, tuple(ranks) if ranks is not None else None, level)


# DeepSpeed's code calls these as methods of its logger
logger.warning_once = warning_once  # type: ignore[attr-defined]
logger.log_dist_once = log_dist_once  # type: ignore[attr-defined]


def print_configuration(args: Any, name: str) -> None:
    """Log ``name:`` and then every attribute of ``args``, sorted, at INFO."""
    logger.info("%s:", name)
    for arg in sorted(vars(args)):
        logger.info("  %s %s %s", arg, "." * (29 - len(arg)), getattr(args, arg))


def print_json_dist(message: dict, ranks: list[int] | None = None, path: str | None = None) -> None:
    """Write ``message`` (with this rank under ``"rank"``) as JSON to ``path`` on the ranks
    :func:`log_dist` would log on."""
    import torch.distributed as dist

    if get_dist_msg("", ranks) is None:
        return
    message["rank"] = dist.get_rank() if dist.is_initialized() else -1
    with open(path, "w") as out:  # type: ignore[arg-type]
        json.dump(message, out)
        out.flush()
        os.fsync(out.fileno())


def get_log_level_from_string(log_level_str: str) -> int:
    """``"info"`` -> ``logging.INFO`` (any case); another name is a ValueError."""
    level = log_level_str.lower()
    if level not in log_levels:
        raise ValueError(f"{log_level_str} is not one of the valid logging levels. Valid log levels are "
                         f"{log_levels.keys()}.")
    return log_levels[level]


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """Set the level of ``custom_logger`` (default: :data:`logger`) and of its handlers."""
    level = get_log_level_from_string(log_level_str)
    target = logger if custom_logger is None else custom_logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def get_current_level() -> int:
    """The effective level of :data:`logger`."""
    return logger.getEffectiveLevel()


def should_log_le(max_log_level_str: str) -> bool:
    """Whether :data:`logger` logs at ``max_log_level_str`` (``should_log_le("info")`` is True at
    INFO and DEBUG)."""
    if not isinstance(max_log_level_str, str):
        raise ValueError(f"{max_log_level_str} is not a string")
    return get_current_level() <= get_log_level_from_string(max_log_level_str)
