"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: DeepSpeed's ``UlyssesSPAttentionHF`` (with
``register_with_transformers``; :mod:`zkit_deepspeed.ulysses_hf`) and ``UlyssesSPDataLoaderAdapter``.

``UlyssesSPDataLoaderAdapter(dl, sp_rank, sp_group, sp_world_size, device)`` takes one batch (a
dict with ``input_ids``, ``position_ids`` and ``labels``, tensors ``[batch, seq, ...]``) on each of
the ``sp_world_size`` ranks of ``sp_group``, shares them, and yields them in turn, each sliced to this
rank's part of the sequence, as DeepSpeed does: ``labels`` becomes ``shift_labels`` (the next
token's label, ``-100`` after the last), computed before slicing; other tensors are sliced along
dim 1; non-tensors go to every rank unchanged. A batch without ``position_ids``, one whose tensors
disagree in length, or a length not divisible by the group's size is refused, with DeepSpeed's
words. The rest of the module (ALST's tiled autograd functions) is refused with a message naming
zkit-sequence's counterparts.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Iterable

import torch

from deepspeed.refused import module_getattr
from zkit_deepspeed.ulysses_hf import UlyssesSPAttentionHF

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]

__getattr__ = module_getattr(__name__)


class UlyssesSPDataLoaderAdapter:
    def __init__(self, dl: Iterable[Any], sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        self.dl = dl
        self.sp_rank, self.sp_group, self.sp_world_size = sp_rank, sp_group, sp_world_size
        self.device = device
        self.iter = iter(dl)
        self.micro_batches: deque[dict] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size  # type: ignore[arg-type]

    def __iter__(self) -> "UlyssesSPDataLoaderAdapter":
        return self

    def __next__(self) -> dict:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next epoch starts over, as DeepSpeed's
            raise
        if "position_ids" not in batch:
            raise ValueError("Ulysses SP requires `position_ids` in every dataloader batch so that each token retains "
                             "its correct global position after sequence sharding")
        seqlen = batch["input_ids"].shape[1]
        for key, value in batch.items():
            if torch.is_tensor(value) and value.shape[1] != seqlen:
                raise ValueError(f"{key}'s shape {value.shape} must match input_ids's shape {batch['input_ids'].shape}")
        everyone = [None] * self.sp_world_size
        torch.distributed.all_gather_object(everyone, {k: v.cpu() if torch.is_tensor(v) else v
                                                       for k, v in batch.items()}, group=self.sp_group)
        for whole in everyone:
            self.micro_batches.append(self._slice(dict(whole)))

    def _slice(self, batch: dict) -> dict:
        seq_length = batch["input_ids"].shape[1]
        if seq_length % self.sp_world_size:
            raise ValueError(f"batch's seqlen={seq_length} isn't divisible by sp-size={self.sp_world_size}")
        chunk = seq_length // self.sp_world_size
        labels = torch.nn.functional.pad(batch.pop("labels"), (0, 1), value=-100)
        batch["shift_labels"] = labels[..., 1:].contiguous()
        return {k: v[:, chunk * self.sp_rank:chunk * (self.sp_rank + 1)].to(self.device) if torch.is_tensor(v) else v
                for k, v in batch.items()}
