"""Attention implementations by name: the model side of the ``attention`` plugin family.

A model asks for its attention module by name and never imports an implementation::

    attn = zkit.core.attention.build_attention("dense", causal=True, num_heads=8, head_dim=64)
    out = attn(q, k, v)                       # [batch, heads, seq, head_dim] each

``"dense"`` is zkit's own (:mod:`zkit.models.dense_attention`); ``"block_sparse"`` comes from the
``zkit-sparse`` distribution. Every implementation follows one calling convention, so swapping one
for another changes no model code:

``module(query, key, value, key_padding_mask=None, attn_mask=None) -> Tensor``
    ``query`` is ``[batch, heads, seq_q, head_dim]``, ``key``/``value`` are
    ``[batch, heads, seq_k, head_dim]``; the result has ``query``'s shape.

Masks follow DeepSpeed's ``SparseSelfAttention``:

* ``key_padding_mask``: ``[batch, seq_k]`` (a ``[batch, 1, 1, seq_k]`` extended mask is accepted).
  With ``key_padding_mask_mode="add"`` (the default) it is added to the scores: 0 keeps a key,
  ``-inf`` (or a large negative number such as BERT's -10000) drops it. With ``"mul"`` a non-zero
  value keeps a key and 0 drops it.
* ``attn_mask``: ``[seq_q, seq_k]``. With ``attn_mask_mode="mul"`` (the default) 1 keeps a
  query-key pair and 0 drops it; with ``"add"`` it is added to the scores.
* A ``torch.bool`` mask means ``True`` = attend, whatever the mode (torch's own convention).

Factories receive ``causal`` and ``dropout`` plus the model geometry ``num_heads``, ``head_dim`` and
``max_seq_length`` (so that a sparse layout can be built once), and then whatever the user put in
the model's ``attention_kwargs``. An option an implementation does not know is an error, never
ignored.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from zkit.core.plugin_manager import ZkitPluginManager, get_plugin_manager
from zkit.core.records import AttentionRecord

MASK_MODES = ("add", "mul")

_manager: ZkitPluginManager | None = None


def _plugin_manager() -> ZkitPluginManager:
    # Building the manager imports every installed plugin: do it once per process.
    global _manager
    if _manager is None:
        _manager = get_plugin_manager()
    return _manager


def attention_record(name: str) -> AttentionRecord:
    """The registered record called ``name``; an unknown name lists the valid ones."""
    record = _plugin_manager().lookup("attention", name)
    assert isinstance(record, AttentionRecord)
    return record


def available_attention() -> list[str]:
    """Names of every attention implementation installed (aliases not repeated)."""
    return sorted({r.name for r in _plugin_manager().records("attention").values()})


def build_attention(name: str, **kwargs: Any) -> nn.Module:
    """Build the attention module registered as ``name`` with ``kwargs``.

    Raises :class:`zkit.core.plugin_manager.PluginError` for an unknown name (naming the distribution to
    install when zkit knows it) and :class:`TypeError` for options the implementation does not
    take.
    """
    record = attention_record(name)
    module = record.factory(**kwargs)
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"attention {record.name!r} from {record.dist!r} built a {type(module).__name__}, "
            "not a torch.nn.Module"
        )
    return module
