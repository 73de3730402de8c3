"""Causal LMs whose head shares the token embedding's weight (GPT-2's and most Hugging Face causal
LMs' tying), trained with the real DeepSpeed, saved, and continued: the reference for importing
DeepSpeed checkpoints of tied models. The models and data are plain PyTorch, imported by the zkit
side too; the run itself needs DeepSpeed's interpreter (``.venv-peers``):

    DS_ACCELERATOR=cpu .venv-peers/bin/python tests/deepspeed_peer_tied.py --out DIR --runs 2:fp32,3:fp32

Every run ``STAGE:DTYPE`` trains ``--before`` steps on ``--world`` gloo ranks, saves
``DIR/tied-<run>/``, trains ``--after`` more steps and records every step's loss (the global
batch's mean) in ``DIR/tied-results.json``. A run ``STAGE:gpt`` trains :class:`TiedGPT` with
:func:`gpt_config` instead, into ``DIR/tied-gpt-<STAGE>/``.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

#: odd sizes: DeepSpeed pads parameters and partitions, the import must see through both
VOCAB, DIM, SEQ = 11, 6, 5
GLOBAL_BATCH = 8


class TiedLM(nn.Module):
    """Embedding, one mixing layer, a layer norm and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.wte(tokens)
        h = h + torch.tanh(self.mix(h))
        logits = self.head(self.norm(h))
        return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def tied_batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of global batch ``step`` (the same global batch at any world size)."""
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    share = GLOBAL_BATCH // world_size
    mine = tokens[rank * share:(rank + 1) * share]
    return mine[:, :-1], mine[:, 1:]


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, 2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


GPT_VOCAB, GPT_SEQ = 2048, 64


class TiedGPT(nn.Module):
    """A GPT of 2 blocks, width 128, whose head is tied after construction, as most scripts tie it.
    Its tied weight starts as an embedding's (unit variance), so its logits and its gradient norm
    are large: DeepSpeed 0.19.8's default clipping acts at every step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.pos = nn.Embedding(GPT_VOCAB, 128), nn.Embedding(GPT_SEQ, 128)
        self.blocks = nn.ModuleList(Block(128, 4) for _ in range(2))
        self.ln = nn.LayerNorm(128)
        self.head = nn.Linear(128, GPT_VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x)).float()
        return nn.functional.cross_entropy(logits.reshape(-1, GPT_VOCAB), targets.reshape(-1))


def gpt_batches(step: int, rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of global batch ``step``: two micro-batches of 4 sequences, one per
    rank on 2 ranks, both accumulated on 1 (mostly a repeating pattern, so the loss falls)."""
    out = []
    for m in ([rank] if world_size == 2 else [0, 1]):
        g = torch.Generator().manual_seed(1000 * step + m)
        x = torch.randint(0, GPT_VOCAB, (4, GPT_SEQ + 1), generator=g)
        for t in range(1, GPT_SEQ + 1):
            keep = torch.rand(4, generator=g) < 0.8
            x[:, t] = torch.where(keep, (x[:, t - 1] * 7 + 3) % GPT_VOCAB, x[:, t])
        out.append((x[:, :-1], x[:, 1:]))
    return out


def gpt_config(stage: int, world_size: int) -> dict:
    """DeepSpeed's config of the :class:`TiedGPT` run as a user writes it: DeepSpeed's own AdamW
    (FusedAdam), and no ``gradient_clipping`` key, so DeepSpeed 0.19.8 clips at its default, 1.0."""
    return {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2 // world_size,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 1_000_000}


def _rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    from deepspeed_peer_run import finish, join, train_save_continue

    join(rank, world, port)
    import deepspeed

    from deepspeed_peer_model import ds_config

    results = {}
    for run in args.runs.split(","):
        stage, dtype = run.split(":")
        gpt = dtype == "gpt"
        if gpt and world != 2:
            raise SystemExit(f"{run}: the TiedGPT reference runs on 2 ranks, one micro-batch each, not {world}")
        model = TiedGPT() if gpt else TiedLM()
        config = gpt_config(int(stage), world) if gpt else ds_config(int(stage), world, dtype)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                          dist_init_required=False)
        name = f"tied-gpt-{stage}" if gpt else "tied-" + run.replace(":", "-")
        batch_of = (lambda k: gpt_batches(k, rank, world)[0]) if gpt else (lambda k: tied_batch(k, rank, world))
        results[name] = train_save_continue(engine, batch_of, name, args, world)
        engine.destroy()
        del engine
    finish(results, os.path.join(args.out, "tied-results.json"), rank)


if __name__ == "__main__":
    from deepspeed_peer_run import launch, parse_args

    launch(_rank, parse_args("2:fp32,3:fp32", 2))
