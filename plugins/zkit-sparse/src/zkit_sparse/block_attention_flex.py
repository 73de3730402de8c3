"""Block-sparse attention on PyTorch's FlexAttention: the CUDA path when torch provides it.

The layout becomes a ``BlockMask`` (:mod:`zkit_sparse.flex_block_mask`, built once per sequence
length by the module); the user's key-padding and attention masks, already in additive form
(``-inf`` = masked, as DeepSpeed's ``mul`` mode becomes), are added to the scores by a
``score_mod``. The scale is applied before the ``score_mod``, as DeepSpeed adds its masks to the
scaled scores. A row whose keys are all masked comes out as zeros.

The call goes through one ``torch.compile(flex_attention)`` per process (CUDA calls by default, CPU
calls with ``flex_compile=True``): it compiles once per input shape, dtype and kind of
``score_mod``; new mask tensors of the same shape, and the BlockMasks of other modules with the
same geometry, reuse the compiled kernel (they are inputs of the graph, not constants). It is the
graph a hand-written ``torch.compile(flex_attention)`` call with a ``create_block_mask`` mask
runs (``tests/test_flex_same_graph.py`` compares them on the CPU). Without compilation
FlexAttention materialises the scores; on the CPU it has no backward, so there it serves
inference and the checks of the mask construction, and the batched PyTorch path does the
training.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from zkit_sparse.flex_backward_tiles import check_backward_tile

#: compiled ``flex_attention`` per torch.compile backend
_COMPILED: dict[Any, Callable] = {}


def _flex_attention(compile_backend: Any) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    if compile_backend is None:
        return flex_attention
    if compile_backend not in _COMPILED:
        # dynamic=False: one kernel per shape, no guard churn from automatic dynamic shapes
        _COMPILED[compile_backend] = torch.compile(flex_attention, dynamic=False, backend=compile_backend)
    return _COMPILED[compile_backend]


def _pad_to(mask: torch.Tensor, dims: tuple[int, ...], size: int) -> torch.Tensor:
    """Zero-pad ``mask`` along ``dims`` to ``size``: tiles reach past the sequence, and the kernel
    reads the score_mod's tensors there before it discards those positions."""
    widths: list[int] = []
    for dim in reversed(range(mask.dim())):
        widths += [0, size - mask.shape[dim] if dim in dims else 0]
    return torch.nn.functional.pad(mask, widths) if any(widths) else mask


def mask_score_mod(key_padding: torch.Tensor | None, attn: torch.Tensor | None, reach: int):
    """``score_mod`` adding ``key_padding[b, kv]`` ([B, T]) and ``attn[q, kv]`` ([T, T]), or None."""
    kp = None if key_padding is None else _pad_to(key_padding, (1,), reach)
    am = None if attn is None else _pad_to(attn, (0, 1), reach)
    if kp is None and am is None:
        return None
    if am is None:
        def add_key_padding(score, b, h, q_idx, kv_idx):
            return score + kp[b, kv_idx]
        return add_key_padding
    if kp is None:
        def add_attn_mask(score, b, h, q_idx, kv_idx):
            return score + am[q_idx, kv_idx]
        return add_attn_mask

    def add_both(score, b, h, q_idx, kv_idx):
        return score + kp[b, kv_idx] + am[q_idx, kv_idx]
    return add_both


def flex_block_sparse_attention(q, k, v, block_mask, scale: float,
                                key_padding: torch.Tensor | None = None,
                                attn_mask: torch.Tensor | None = None, *,
                                compile_backend: Any = "inductor",
                                kernel_options: dict[str, Any] | None = None) -> torch.Tensor:
    """Attention of ``[B, H, T, d]`` tensors over ``block_mask`` with additive masks.

    ``compile_backend=None`` runs FlexAttention eagerly (forward only on the CPU). Nothing else
    runs on the tensors: the call dispatches the ops a hand-written compiled ``flex_attention``
    call dispatches, plus the padding of masks when some are given."""
    trains = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if trains and q.is_cuda:  # refused before compiling, not at the first backward
        check_backward_tile(tuple(block_mask.BLOCK_SIZE), q.shape[-1], q.dtype, q.device)
    elif trains and q.device.type == "cpu":  # compiled or not: torch raises NotImplementedError
        raise RuntimeError(
            "backend 'flex' on the CPU runs the forward only (torch's FlexAttention has no CPU "
            "backward); use backend='torch' to train on the CPU, or call under torch.no_grad()")
    if compile_backend is None and not torch.is_grad_enabled():
        # eager CPU FlexAttention refuses inputs that require grad even under no_grad
        q, k, v = q.detach(), k.detach(), v.detach()
    score_mod = None
    if key_padding is not None or attn_mask is not None:
        reach = max(block_mask.BLOCK_SIZE[0] * block_mask.kv_num_blocks.shape[-1],
                    block_mask.BLOCK_SIZE[1] * block_mask.kv_indices.shape[-1])
        score_mod = mask_score_mod(key_padding, attn_mask, reach)
    flex = _flex_attention(compile_backend)
    kwargs = {} if kernel_options is None else {"kernel_options": kernel_options}
    return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, **kwargs)
