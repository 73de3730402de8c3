"""``deepspeed.ops``: optimizers (``ops.adam``); block-sparse attention (``ops.sparse_attention``)
when zkit-sparse is installed."""
