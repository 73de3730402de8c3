"""Datasets for zkit's examples and tests."""
from __future__ import annotations

from zkit.data.repeating import RepeatingLoader
from zkit.data.text import VOCAB_SIZE, ByteTextDataset, decode, encode

__all__ = ["VOCAB_SIZE", "ByteTextDataset", "RepeatingLoader", "decode", "encode"]
