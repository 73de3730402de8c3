"""Activation bytes of zkit's GPT (:mod:`zkit.models.gpt`) for one micro-batch on one rank.

Counted tensor by tensor from what autograd saves in that model (checked against the saved-tensor
hooks of a real forward in ``tests/test_estimate.py``), with ``b`` batch, ``s`` sequence, ``d``
d_model, ``a`` heads, ``V`` vocabulary, ``p`` bytes per activation element:

* per block, ``16 b s d p``: LayerNorm inputs (2), their outputs feeding the QKV and MLP matmuls
  (2), the QKV output (3), the attention output (1; fused kernels lay it out so that the
  projection's input is a view of it), GELU's input (4) and output (4); 4 LayerNorm statistics per row
  ``4 b s 4``; the fused attention kernel's log-sum-exp ``b a s 4``; with dropout, two masks of
  ``b s d`` bytes (attention-probability dropout in fused kernels keeps only an RNG offset);
* the head: the final LayerNorm's input and output ``2 b s d p`` (+ stats), and the fp32 log-probs
  cross-entropy keeps, ``b s V 4``; token ids and targets; the embedding dropout mask.

``attention="math"`` (the unfused path, used where no fused kernel applies) also keeps the
probabilities, their dropout mask and the dropped probabilities: ``b a s^2 (2p + 1)``.

With checkpointing every block keeps only its input (``b s d p``); backward recomputes one block
at a time, so the peak adds one block's activations.
"""
from __future__ import annotations

from typing import Any

ATTENTION_KERNELS = ("flash", "math")


def gpt_activation_bytes(
    config: Any,
    batch: int,
    seq: int | None = None,
    *,
    dtype_bytes: int = 2,
    checkpointing: bool = False,
    attention: str = "flash",
    tensor_parallel: int = 1,
) -> dict[str, int]:
    """``{"saved", "per_block", "peak"}`` in bytes. ``saved``: what the forward leaves for backward;
    ``peak``: ``saved`` plus, with checkpointing, one block being recomputed. ``tensor_parallel``
    divides the split tensors (attention and MLP interiors) by the tensor-parallel degree."""
    for label, value in (("batch", batch), ("tensor_parallel", tensor_parallel)):
        if type(value) is not int or value < 1:
            raise ValueError(f"{label} must be an int >= 1, got {value!r}")
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_KERNELS)}, got {attention!r}")
    s = config.seq_len if seq is None else seq
    if type(s) is not int or not 1 <= s <= config.seq_len:
        raise ValueError(f"seq must be an int in [1, {config.seq_len}] (the model's seq_len), got {s!r}")
    b, d, a, V, p, t = batch, config.d_model, config.n_head, config.vocab_size, dtype_bytes, tensor_parallel
    bsd = b * s * d
    masks = 2 * bsd if config.dropout > 0 else 0
    # Replicated over the tensor group: LN inputs/outputs (4); split: QKV (3), attention out (1), MLP (8).
    block = 4 * bsd * p + (12 * bsd * p) // t + 4 * b * s * 4 + (b * a * s * 4) // t + masks
    if attention == "math":
        block += (b * a * s * s * (2 * p + (1 if config.dropout > 0 else 0))) // t
    head = 2 * bsd * p + 2 * b * s * 4 + b * s * V * 4 + 2 * b * s * 8 + s * 8 + 4
    if config.dropout > 0:
        head += bsd  # embedding dropout mask
    if checkpointing:
        saved = config.n_layer * bsd * p + head
        return {"saved": saved, "per_block": bsd * p, "peak": saved + block}
    saved = config.n_layer * block + head
    return {"saved": saved, "per_block": block, "peak": saved}
