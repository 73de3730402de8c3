"""Small models and probes shared by several test files (module level: ranks import them)."""
from __future__ import annotations

import torch
from torch import nn

from zkit.models.gpt import Block, GPTConfig


class SharedNet(nn.Module):
    """GPT blocks with dropout; block 1 reuses block 0's MLP input layer (one parameter in two
    checkpointed regions) and the head is tied to the embedding (outside every region)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=32, seq_len=8, n_layer=3, n_head=2, d_model=16, dropout=0.1)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.blocks[1].mlp.fc = self.blocks[0].mlp.fc

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        logits = h @ self.embed.weight.t()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def saved_tensor_bytes(model: nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the storages autograd keeps for backward in ``model(ids, ids)``, each once,
    parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, ids)
    return sum(seen.values())
