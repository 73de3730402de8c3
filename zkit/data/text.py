"""Byte-level language-modelling data: any text file, vocabulary of 256, no tokenizer.

Each example is a window of ``seq_len`` bytes and the same window shifted by one byte::

    input_ids = corpus[start     : start + seq_len]
    labels    = corpus[start + 1 : start + seq_len + 1]

so ``labels[t]`` is the byte that follows ``input_ids[t]`` (the model does not shift again).
Windows start at multiples of ``stride`` (default ``seq_len``: non-overlapping), item ``i`` is always
the same window, and the split is by position: the last ``val_fraction`` of the bytes is the
validation split and no training window reaches into it.

Uncompressed files are memory-mapped, so a corpus larger than memory works; ``.gz`` files are
decompressed into memory once.
"""
from __future__ import annotations

import gzip
import os
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

VOCAB_SIZE = 256
SPLITS = ("train", "val")


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a LongTensor of ids in ``[0, 256)``."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long, device="cpu")


def decode(ids: torch.Tensor | list[int]) -> str:
    """Text from byte ids; an incomplete UTF-8 sequence (a window cut mid-character) shows as U+FFFD."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return bytes(int(v) & 0xFF for v in values).decode("utf-8", errors="replace")


def _load_bytes(path: str) -> np.ndarray:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"text corpus {path!r} does not exist")
    if path.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            return np.frombuffer(f.read(), dtype=np.uint8)
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")


class ByteTextDataset(Dataset):
    """``(input_ids, labels)`` LongTensor pairs of length ``seq_len`` from a text file.

    Args:
        path: a text file, optionally gzip-compressed (``.gz``).
        seq_len: bytes per example.
        split: ``"train"`` (the first ``1 - val_fraction`` of the bytes) or ``"val"`` (the rest).
        val_fraction: share of the corpus held out for validation, in ``(0, 1)``.
        stride: distance between the starts of consecutive windows (``seq_len`` by default).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        seq_len: int,
        split: Literal["train", "val"] = "train",
        val_fraction: float = 0.05,
        stride: int | None = None,
    ) -> None:
        if not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        if split not in SPLITS:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
        stride = seq_len if stride is None else stride
        if not isinstance(stride, int) or stride <= 0:
            raise ValueError(f"stride must be a positive integer, got {stride!r}")
        self.path = os.fspath(path)
        self.seq_len = seq_len
        self.split = split
        self.stride = stride
        self.val_fraction = val_fraction
        self.data = self._split_bytes()
        # A window needs seq_len + 1 bytes (inputs plus the byte after the last input).
        usable = len(self.data) - (seq_len + 1)
        if usable < 0:
            raise ValueError(
                f"the {split} split of {self.path!r} has {len(self.data)} bytes, fewer than seq_len + 1 = "
                f"{seq_len + 1}; use a shorter seq_len or a larger corpus"
            )
        self._len = usable // stride + 1

    def _split_bytes(self) -> np.ndarray:
        data = _load_bytes(self.path)
        boundary = len(data) - int(len(data) * self.val_fraction)
        return data[:boundary] if self.split == "train" else data[boundary:]

    def __getstate__(self) -> dict:
        # Pickled into data-loader workers: send the path, not the bytes (a memory map would
        # otherwise be copied into the pickle whole).
        return {k: v for k, v in self.__dict__.items() if k != "data"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.data = self._split_bytes()

    def __len__(self) -> int:
        return self._len

    def window_start(self, index: int) -> int:
        """Offset (within this split) of the first input byte of item ``index``."""
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"index {index} out of range for a {self.split} split of {self._len} windows")
        return index * self.stride

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.window_start(int(index))
        window = torch.from_numpy(np.array(self.data[start : start + self.seq_len + 1], dtype=np.int64))
        return window[:-1], window[1:]

    def __repr__(self) -> str:
        return (
            f"ByteTextDataset({self.path!r}, seq_len={self.seq_len}, split={self.split!r}, "
            f"{len(self.data):,} bytes, {self._len:,} windows)"
        )
