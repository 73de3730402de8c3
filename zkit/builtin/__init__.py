"""zkit's own default plugins. They register through the same hooks as any installed plugin,
``trylast`` where one answer wins, so an installed plugin overrides them."""
from __future__ import annotations

from zkit.builtin import (
    alloc_flat,
    attn_dense,
    checkpoint_formats,
    comm_torch,
    optim_torch,
    partitioners,
    schedules,
    train_loop,
)

#: (plugin name, module): the names ``-p no:NAME`` blocks.
PLUGINS = [
    ("zkit.comm_torch", comm_torch),
    ("zkit.alloc_flat", alloc_flat),
    ("zkit.optim_torch", optim_torch),
    ("zkit.schedules", schedules),
    ("zkit.partitioners", partitioners),
    ("zkit.attn_dense", attn_dense),
    ("zkit.train_loop", train_loop),
    ("zkit.checkpoint_formats", checkpoint_formats),
]
