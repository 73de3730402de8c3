"""Block-sparsity layouts with DeepSpeed's class names, parameters and patterns.

A layout is an integer tensor ``[num_heads, num_blocks, num_blocks]`` whose entry ``[h, i, j]`` is 1
when query block ``i`` of head ``h`` attends to key block ``j``. Code written against DeepSpeed's
``deepspeed.ops.sparse_attention`` ports by changing the import: the same parameters give the same
layout. The random parts (``variable``, ``bigbird``) draw from ``random.Random(seed)`` in the order
DeepSpeed draws from the global ``random`` module, so ``seed=s`` gives DeepSpeed's layout after
``random.seed(s)``; ``seed=None`` draws from the global ``random`` module exactly as DeepSpeed does.
The default ``seed=0`` makes every rank of a data-parallel job build the same layout.

Layouts are built once per sequence length (cached by the attention module), so the short loops
over windows and global indices here run at set-up time only.
"""
from __future__ import annotations

import random
from typing import Sequence

import torch

__all__ = [
    "SparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "VariableSparsityConfig",
    "BigBirdSparsityConfig",
    "BSLongformerSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
]

_ATTENTION_KINDS = ("unidirectional", "bidirectional")


def _check_positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_attention(attention: str) -> str:
    if attention not in _ATTENTION_KINDS:
        raise NotImplementedError(
            f"attention must be 'unidirectional' or 'bidirectional', got {attention!r}"
        )
    return attention


def _check_global_ranges(starts: Sequence[int], ends: Sequence[int] | None) -> None:
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ValueError(
            f"global_block_indices has {len(starts)} entries but global_block_end_indices has "
            f"{len(ends)}; they must have the same length"
        )
    for start, end in zip(starts, ends):
        if start >= end:
            raise ValueError(
                f"global block start index {start} must be smaller than its end index {end}"
            )


class SparsityConfig:
    """Base of every layout: number of heads, block size, one layout or one per head.

    Subclass it and implement :meth:`make_layout` for a new pattern; register the subclass with
    :func:`zkit_sparse.register_layout` so the ``sparse_attention`` config can name it.
    """

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False):
        self.num_heads = _check_positive("num_heads", num_heads)
        self.block = _check_positive("block", block)
        self.different_layout_per_head = bool(different_layout_per_head)
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        """An all-zero ``[num_heads, seq_len // block, seq_len // block]`` int64 layout."""
        if seq_len % self.block != 0:
            raise ValueError(
                f"sequence length {seq_len} is not divisible by the block size {self.block}: pad "
                f"the sequence to a multiple of {self.block} (zkit_sparse.pad_to_block_size)"
            )
        num_blocks = seq_len // self.block
        return torch.zeros((self.num_heads, num_blocks, num_blocks), dtype=torch.int64, device="cpu")

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        """Copy head 0's layout to every head unless each head has its own."""
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """The ``[num_heads, num_blocks, num_blocks]`` layout for ``seq_len`` tokens."""
        raise NotImplementedError(f"{type(self).__name__} does not implement make_layout")

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k != "_rng")
        return f"{type(self).__name__}({fields})"


class _RandomMixin:
    """Random blocks drawn like DeepSpeed draws them, from a seeded generator."""

    seed: int | None

    def _rng(self):
        return random if self.seed is None else random.Random(self.seed)


def _window_ids(num_blocks: int, window_sizes: Sequence[int]) -> torch.Tensor:
    """Local-window index of every block: the listed window sizes, then the last one repeated."""
    sizes = list(window_sizes)
    covered = sum(sizes)
    if covered < num_blocks:
        last = sizes[-1]
        sizes += [last] * (-(-(num_blocks - covered) // last))
    ids = torch.repeat_interleave(torch.arange(len(sizes), device="cpu"), torch.tensor(sizes, device="cpu"))
    return ids[:num_blocks]


def _local_windows(num_blocks: int, window_sizes: Sequence[int], attention: str) -> torch.Tensor:
    ids = _window_ids(num_blocks, window_sizes)
    local = ids[:, None] == ids[None, :]
    if attention == "unidirectional":
        local = torch.tril(local)
    return local


def _sliding_window(num_blocks: int, width: int) -> torch.Tensor:
    if num_blocks < width:
        raise ValueError(
            f"num_sliding_window_blocks ({width}) must not exceed the number of blocks in a row "
            f"({num_blocks})"
        )
    idx = torch.arange(num_blocks, device="cpu")
    return (idx[None, :] - idx[:, None]).abs() <= width // 2


class DenseSparsityConfig(SparsityConfig):
    """Every block present: dense attention, kept for comparison and for switching by config."""

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        layout[:] = 1
        return layout


class FixedSparsityConfig(SparsityConfig):
    """Sparse Transformer's "fixed" pattern (Child et al., 2019) as DeepSpeed customised it.

    Local windows of ``num_local_blocks`` blocks; the last ``num_global_blocks`` blocks of each
    window (a different slot for each of ``num_different_global_patterns`` head groups) are global
    columns every later row (or, bidirectional, every row) attends to, and with
    ``horizontal_global_attention`` also global rows attending to everything.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_local_blocks: int = 4,
        num_global_blocks: int = 1,
        attention: str = "bidirectional",
        horizontal_global_attention: bool = False,
        num_different_global_patterns: int = 1,
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_local_blocks = _check_positive("num_local_blocks", num_local_blocks)
        self.num_global_blocks = _check_positive("num_global_blocks", num_global_blocks)
        if num_local_blocks % num_global_blocks != 0:
            raise ValueError(
                f"num_local_blocks ({num_local_blocks}) must be divisible by num_global_blocks "
                f"({num_global_blocks})"
            )
        self.attention = _check_attention(attention)
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError("horizontal_global_attention needs attention='bidirectional'")
        self.horizontal_global_attention = bool(horizontal_global_attention)
        _check_positive("num_different_global_patterns", num_different_global_patterns)
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError(
                "num_different_global_patterns > 1 needs different_layout_per_head=True (one "
                "layout for all heads has one global pattern)"
            )
        if num_different_global_patterns > num_local_blocks // num_global_blocks:
            raise ValueError(
                f"num_different_global_patterns ({num_different_global_patterns}) cannot exceed "
                f"num_local_blocks // num_global_blocks = {num_local_blocks // num_global_blocks}"
            )
        self.num_different_global_patterns = num_different_global_patterns

    def _set_global(self, layout: torch.Tensor, h: int, start: int, end: int) -> None:
        first_row = 0 if self.attention == "bidirectional" else start
        layout[h, first_row:, start:end] = 1
        if self.horizontal_global_attention:
            layout[h, start:end, :] = 1

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        nb = layout.shape[1]
        local = _local_windows(nb, [self.num_local_blocks], self.attention)
        g, w = self.num_global_blocks, self.num_local_blocks
        for h in range(self.num_layout_heads):
            layout[h] = local
            first = w - (1 + h % self.num_different_global_patterns) * g
            full_end = nb - nb % w
            for start in range(first, full_end, w):
                self._set_global(layout, h, start, start + g)
            if full_end < nb:  # a short last window still gets its global blocks
                start = min(full_end + first, nb - g)
                self._set_global(layout, h, start, start + g)
        return self.check_and_propagate_first_head_layout(layout)


class VariableSparsityConfig(SparsityConfig, _RandomMixin):
    """Fixed's generalisation: random blocks, a list of local window sizes (the last one repeats)
    and explicit global block indices (or ``[start, end)`` ranges with ``global_block_end_indices``).

    As in DeepSpeed, random blocks are drawn from the whole row even for unidirectional attention;
    a causal attention module drops the blocks above the diagonal.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 0,
        local_window_blocks: Sequence[int] = (4,),
        global_block_indices: Sequence[int] = (0,),
        global_block_end_indices: Sequence[int] | None = None,
        attention: str = "bidirectional",
        horizontal_global_attention: bool = False,
        seed: int | None = 0,
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        if num_random_blocks < 0:
            raise ValueError(f"num_random_blocks must be >= 0, got {num_random_blocks}")
        self.num_random_blocks = num_random_blocks
        if not local_window_blocks:
            raise ValueError("local_window_blocks must list at least one window size")
        for size in local_window_blocks:
            _check_positive("every local_window_blocks entry", size)
        self.local_window_blocks = list(local_window_blocks)
        self.global_block_indices = list(global_block_indices)
        _check_global_ranges(self.global_block_indices, global_block_end_indices)
        self.global_block_end_indices = (
            None if global_block_end_indices is None else list(global_block_end_indices)
        )
        self.attention = _check_attention(attention)
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError("horizontal_global_attention needs attention='bidirectional'")
        self.horizontal_global_attention = bool(horizontal_global_attention)
        self.seed = seed

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        nb = layout.shape[1]
        if nb < self.num_random_blocks:
            raise ValueError(
                f"num_random_blocks ({self.num_random_blocks}) must not exceed the number of "
                f"blocks in a row ({nb})"
            )
        rng = self._rng()
        local = _local_windows(nb, self.local_window_blocks, self.attention)
        ends = self.global_block_end_indices or [i + 1 for i in self.global_block_indices]
        for h in range(self.num_layout_heads):
            for row in range(nb):
                layout[h, row, rng.sample(range(nb), self.num_random_blocks)] = 1
            layout[h] |= local
            for start, end in zip(self.global_block_indices, ends):
                if start >= nb:
                    continue
                end = min(end, nb)
                if self.horizontal_global_attention:
                    layout[h, start:end, :] = 1
                first_row = 0 if self.attention == "bidirectional" else start
                layout[h, first_row:, start:end] = 1
        return self.check_and_propagate_first_head_layout(layout)


class BigBirdSparsityConfig(SparsityConfig, _RandomMixin):
    """BigBird (Zaheer et al., 2020): random blocks, a sliding window and the first
    ``num_global_blocks`` blocks as global rows and columns."""

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 1,
        num_sliding_window_blocks: int = 3,
        num_global_blocks: int = 1,
        attention: str = "bidirectional",
        seed: int | None = 0,
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        if num_random_blocks < 0:
            raise ValueError(f"num_random_blocks must be >= 0, got {num_random_blocks}")
        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = _check_positive(
            "num_sliding_window_blocks", num_sliding_window_blocks
        )
        self.num_global_blocks = _check_positive("num_global_blocks", num_global_blocks)
        self.attention = _check_attention(attention)
        self.seed = seed

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        nb = layout.shape[1]
        for name in ("num_random_blocks", "num_global_blocks"):
            if nb < getattr(self, name):
                raise ValueError(
                    f"{name} ({getattr(self, name)}) must not exceed the number of blocks in a "
                    f"row ({nb})"
                )
        rng = self._rng()
        window = _sliding_window(nb, self.num_sliding_window_blocks)
        g = self.num_global_blocks
        uni = self.attention == "unidirectional"
        for h in range(self.num_layout_heads):
            for row in range(nb):
                # A causal row has only row + 1 blocks to draw from (DeepSpeed fails there).
                population = range(row + 1) if uni else range(nb)
                k = min(self.num_random_blocks, len(population))
                layout[h, row, rng.sample(population, k)] = 1
            layout[h] |= window
            layout[h, :g, :] = 1
            layout[h, :, :g] = 1
            if uni:
                layout[h] = torch.tril(layout[h])
        return self.check_and_propagate_first_head_layout(layout)


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer (Beltagy et al., 2020): a sliding window plus global blocks that
    attend to and are attended by every block."""

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_sliding_window_blocks: int = 3,
        global_block_indices: Sequence[int] = (0,),
        global_block_end_indices: Sequence[int] | None = None,
        attention: str = "bidirectional",
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_sliding_window_blocks = _check_positive(
            "num_sliding_window_blocks", num_sliding_window_blocks
        )
        self.global_block_indices = list(global_block_indices)
        _check_global_ranges(self.global_block_indices, global_block_end_indices)
        self.global_block_end_indices = (
            None if global_block_end_indices is None else list(global_block_end_indices)
        )
        self.attention = _check_attention(attention)

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        nb = layout.shape[1]
        window = _sliding_window(nb, self.num_sliding_window_blocks)
        ends = self.global_block_end_indices or [i + 1 for i in self.global_block_indices]
        for h in range(self.num_layout_heads):
            layout[h] = window
            for start, end in zip(self.global_block_indices, ends):
                if start < nb:
                    layout[h, start : min(end, nb), :] = 1
                    layout[h, :, start : min(end, nb)] = 1
            if self.attention == "unidirectional":
                layout[h] = torch.tril(layout[h])
        return self.check_and_propagate_first_head_layout(layout)


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A purely local sliding window of ``num_sliding_window_blocks`` blocks (causal by default)."""

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        num_sliding_window_blocks: int = 3,
        attention: str = "unidirectional",
    ):
        super().__init__(num_heads, block)
        self.num_sliding_window_blocks = _check_positive(
            "num_sliding_window_blocks", num_sliding_window_blocks
        )
        self.attention = _check_attention(attention)

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        window = _sliding_window(layout.shape[1], self.num_sliding_window_blocks)
        if self.attention == "unidirectional":
            window = torch.tril(window)
        layout[:] = window
        return layout
