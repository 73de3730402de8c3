"""Rank functions for tests/test_export_formats.py."""
from __future__ import annotations

import torch

import zkit


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(100 * step + rank))


def train_gpt2_and_save(ckpt: str, config_dir: str, stage: int) -> dict:
    """Train a tiny transformers GPT-2 two steps, save; the logits of a probe batch after training."""
    from zkit.zero import GatheredParameters

    model = _tiny_gpt2()
    if torch.distributed.get_rank() == 0:
        model.config.save_pretrained(config_dir)
    engine, *_ = zkit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    for step in range(2):
        out = engine(input_ids=_batch(step, engine.rank), labels=_batch(step, engine.rank))
        engine.backward(out.loss)
        engine.step()
    engine.save_checkpoint(ckpt, tag="t")
    engine.eval()
    with torch.no_grad(), GatheredParameters(list(model.parameters())):
        logits = engine(input_ids=_batch(99, 0)).logits.clone()
    engine.close()
    return {"logits": logits}


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 10)
        self.b = torch.nn.Linear(10, 6)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}


def _steps(engine, start: int, n: int) -> list[float]:
    world = torch.distributed.get_world_size()
    losses = []
    for step in range(start, start + n):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        mine = x.chunk(world)[engine.rank] if world > 1 else x
        loss = engine(mine).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def save_small(ckpt: str, stage: int) -> dict:
    torch.manual_seed(0)
    engine, *_ = zkit.initialize(model=_Net(), config=_config(stage))
    _steps(engine, 0, 3)
    engine.save_checkpoint(ckpt, tag="t")
    after = _steps(engine, 3, 3)
    engine.close()
    return {"after": after}


def resume_small(source: str, stage: int, tag: str | None) -> dict:
    torch.manual_seed(5)  # other initial weights: the load must replace them
    engine, *_ = zkit.initialize(model=_Net(), config=_config(stage))
    engine.load_checkpoint(source, tag=tag)
    after = _steps(engine, 3, 3)
    engine.close()
    return {"after": after}


def load_weights_only(path: str) -> None:
    engine, *_ = zkit.initialize(model=_Net(), config=_config(2))
    engine.load_checkpoint(path, load_optimizer_states=False)
    engine.close()
