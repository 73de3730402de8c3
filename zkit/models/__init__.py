"""Reference models that exercise zkit end to end (tied weights, attention plugins, blocks that
checkpointing and pipelining can find)."""
from __future__ import annotations

from zkit.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
