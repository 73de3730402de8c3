"""Which FlexAttention tiles the compiled backward can lower, asked before compiling.

Inductor lowers ``flex_attention_backward`` with the kernel configs of its heuristics for the GPU,
head_dim and dtype (one config outside max-autotune), and keeps only configs whose kernel tiles
(``BLOCK_M1``, ``BLOCK_N1``, ``BLOCK_M2``, ``BLOCK_N2``) divide the BlockMask's tiles. The check
uses the heuristic's tiles, not the ``kernel_options`` given to ``flex_attention``, so a tile the
heuristic cannot divide fails after the forward compiled, at the first backward, with
``NoValidChoicesError``. On an H100 (compute capability 9.0) with head_dim 64 the backward config
is ``(64, 128, 128, 64)``: both tiles must be multiples of 128, and ``flex_block_size=(128, 64)``
cannot train. Here the same rule is applied up front, with a message that says what to change.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

#: (block_m1, block_n1, block_m2, block_n2) of each backward config
BackwardTiles = tuple[int, int, int, int]


def tiles_fit(tile: tuple[int, int], conf: BackwardTiles) -> bool:
    """Inductor's condition: the config's kernel tiles divide the (query, key) BlockMask tile."""
    q_tile, kv_tile = tile
    m1, n1, m2, n2 = conf
    return kv_tile % n1 == 0 and q_tile % m1 == 0 and kv_tile % n2 == 0 and q_tile % m2 == 0


def inductor_backward_tiles(head_dim: int, dtype: torch.dtype) -> list[BackwardTiles] | None:
    """The backward configs inductor would try on the current CUDA device, or None when this
    torch does not expose them (then nothing is refused up front)."""
    try:
        from torch._inductor.choices import InductorChoices

        configs = InductorChoices().get_flex_attention_bwd_configs(head_dim, dtype, "cuda")
        return [(c.block_m1, c.block_n1, c.block_m2, c.block_n2) for c in configs]
    except Exception:  # a private API: its absence must not stop training
        return None


def backward_tile_problem(tile: tuple[int, int], head_dim: int, dtype: torch.dtype,
                          configs: Sequence[BackwardTiles] | None) -> str | None:
    """Why FlexAttention's backward cannot run ``tile`` with these ``configs``, or None."""
    if configs is None or any(tiles_fit(tile, c) for c in configs):
        return None
    device = ""
    if torch.cuda.is_available():
        device = f" on compute capability {'.'.join(map(str, torch.cuda.get_device_capability()))}"
    needs = " or ".join(f"{c}: query tile a multiple of {math.lcm(c[0], c[2])}, key tile a "
                        f"multiple of {math.lcm(c[1], c[3])}" for c in configs)
    return (f"flex_block_size {tile} cannot run FlexAttention's backward{device} with head_dim "
            f"{head_dim} and {str(dtype).replace('torch.', '')} in torch {torch.__version__}: its "
            f"backward kernel tiles (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2) must divide the "
            f"BlockMask's tiles, whatever flex_kernel_options say: {needs}. Use "
            f"flex_block_size=128 (or a tile those divide) "
            f"to train; {tile} runs the forward under torch.no_grad()")


_CHECKED: dict[Any, str | None] = {}


def check_backward_tile(tile: tuple[int, int], head_dim: int, dtype: torch.dtype,
                        device: torch.device,
                        configs_of: Callable[[int, torch.dtype], Sequence[BackwardTiles] | None]
                        = inductor_backward_tiles) -> None:
    """Raise ``ValueError`` when the backward of ``tile`` cannot lower on ``device`` (CUDA);
    answered once per (tile, head_dim, dtype, device)."""
    key = (tile, head_dim, dtype, str(device), configs_of)
    if key not in _CHECKED:
        _CHECKED[key] = backward_tile_problem(tile, head_dim, dtype, configs_of(head_dim, dtype))
    if _CHECKED[key] is not None:
        raise ValueError(_CHECKED[key])
