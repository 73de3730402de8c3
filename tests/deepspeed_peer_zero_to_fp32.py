"""DeepSpeed's own ``zero_to_fp32`` conversions of checkpoints, the reference for zkit's
``deepspeed.utils.zero_to_fp32``. Runs in DeepSpeed's interpreter (``.venv-peers``):

    DS_ACCELERATOR=cpu .venv-peers/bin/python tests/deepspeed_peer_zero_to_fp32.py CKPT...

For every checkpoint directory ``CKPT`` it writes, next to it in ``CKPT.converted/``: ``fp32.pt``
(``get_fp32_state_dict_from_zero_checkpoint``), ``bin/`` (the conversion to one
``pytorch_model.bin``), ``sharded/`` (``max_shard_size`` 500 bytes) and ``safetensors/``
(``safe_serialization``, sharded the same way)."""
from __future__ import annotations

import os
import sys

import torch
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict, get_fp32_state_dict_from_zero_checkpoint

#: bytes per shard: PeerNet's 1.4 KB of weights then fill several shards
SHARD = 500

for checkpoint in sys.argv[1:]:
    out = checkpoint.rstrip("/") + ".converted"
    os.makedirs(out, exist_ok=True)
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint)
    torch.save({k: v.clone() for k, v in state.items()}, os.path.join(out, "fp32.pt"))
    convert_zero_checkpoint_to_fp32_state_dict(checkpoint, os.path.join(out, "bin"))
    convert_zero_checkpoint_to_fp32_state_dict(checkpoint, os.path.join(out, "sharded"), max_shard_size=SHARD)
    convert_zero_checkpoint_to_fp32_state_dict(checkpoint, os.path.join(out, "safetensors"), max_shard_size=SHARD,
                                               safe_serialization=True)
