"""A tiny causal LM whose head shares the token embedding's weight (GPT-2's and most Hugging Face
causal LMs' tying), trained with the real DeepSpeed, saved, and continued: the reference for
importing DeepSpeed checkpoints of tied models. The model and data are plain PyTorch, imported by
the zkit side too; the run itself needs DeepSpeed's interpreter (``.venv-peers``):

    DS_ACCELERATOR=cpu .venv-peers/bin/python tests/deepspeed_peer_tied.py --out DIR --runs 2:fp32,3:fp32

Every run ``STAGE:DTYPE`` trains ``--before`` steps on ``--world`` gloo ranks, saves
``DIR/tied-<run>/``, trains ``--after`` more steps and records every step's loss (the global
batch's mean) in ``DIR/tied-results.json``.
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


def _rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    from deepspeed_peer_run import finish, join, train_save_continue

    join(rank, world, port)
    import deepspeed

    from deepspeed_peer_model import ds_config

    results = {}
    for run in args.runs.split(","):
        stage, dtype = run.split(":")
        model = TiedLM()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(int(stage), world, dtype), dist_init_required=False)
        name = "tied-" + run.replace(":", "-")
        results[name] = train_save_continue(engine, lambda k: tied_batch(k, rank, world), name, args, world)
        engine.destroy()
        del engine
    finish(results, os.path.join(args.out, "tied-results.json"), rank)


if __name__ == "__main__":
    from deepspeed_peer_run import launch, parse_args

    launch(_rank, parse_args("2:fp32,3:fp32", 2))
