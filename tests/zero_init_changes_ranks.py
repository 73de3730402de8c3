"""Rank functions for tests/test_zero_init_changes.py: a GPT built under ``zkit.zero.Init`` whose
parameters change before ``initialize`` (removed, frozen) trains like the same GPT built whole."""
from __future__ import annotations

import torch

import zkit
from zkit.models.gpt import GPT, GPTConfig

STEPS = 3


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16))


def _change(model: GPT, change: str) -> None:
    """What user code does to a built model before handing it to the engine."""
    if change == "bias_none":  # a parameter removed: the unit Init made has one parameter too many
        for block in model.blocks:
            block.attn.qkv.bias = None
    elif change == "weight_replaced":  # a new whole parameter next to a partitioned one
        g = torch.Generator().manual_seed(3)
        for block in model.blocks:
            block.attn.qkv.weight = torch.nn.Parameter(0.02 * torch.randn(block.attn.qkv.weight.shape, generator=g))
    elif change == "bias_frozen":
        for block in model.blocks:
            block.attn.qkv.bias.requires_grad_(False)
    elif change == "bitfit":  # only biases train: every Linear's weight frozen, its bias trainable
        for name, p in model.named_parameters():
            p.requires_grad_(name.endswith(".bias"))
    elif change == "module_frozen":
        model.blocks[0].mlp.requires_grad_(False)
    elif change != "none":
        raise ValueError(change)


def _config(stage: int, unit: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 0,
                              "stage3_gather_unit": unit},
        "steps_per_print": 1000,
    }


def _train(change: str, stage: int, under_init: bool, unit: str = "block") -> dict[str, torch.Tensor]:
    from zkit.zero import GatheredParameters, Init

    cfg = _config(stage, unit)
    if under_init:
        with Init(config=cfg):
            model = _gpt()
    else:
        model = _gpt()
    _change(model, change)
    trainable = [p for p in model.parameters() if p.requires_grad]
    # the units themselves (not their ids: a unit dropped at initialize frees its id for a new one)
    made_by_init = [p._zkit_unit for p in model.parameters() if hasattr(p, "_zkit_unit")]
    engine, *_ = zkit.initialize(model=model, model_parameters=trainable, config=cfg)
    # stage 3's units that are still the ones Init made (not gathered whole and partitioned again)
    units = getattr(engine.partitioner, "sharded", [])
    kept = (sum(any(su is u for u in made_by_init) for su in units), len(units))
    world, rank = engine.world_size, engine.rank
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 32, (STEPS * world * 2, 8), generator=g)
    for step in range(STEPS):
        first = (step * world + rank) * 2
        loss = engine(ids[first : first + 2], ids[first : first + 2].roll(1, dims=1))
        engine.backward(loss)
        engine.step()
    named = list(engine.module.named_parameters())
    with GatheredParameters([p for _, p in named]):
        out = {n: p.detach().float().clone() for n, p in named}
    engine.close()
    return out, kept


def init_against_whole(cases: list[tuple[str, int, str]]) -> dict:
    """Per (change, stage, stage3_gather_unit): the largest parameter difference after training between the model
    built under Init and the one built whole (None: not the same parameter names), and how many of
    stage 3's units out of all are still those Init made; or None and the error a run raised
    (every rank raises it alike, so the next cases still run)."""
    out = {}
    for change, stage, unit in cases:
        whole, _ = _train(change, stage, under_init=False, unit=unit)
        try:
            built, kept = _train(change, stage, under_init=True, unit=unit)
        except Exception as exc:  # noqa: BLE001 - reported per case
            out[(change, stage, unit)] = None, f"{type(exc).__name__}: {exc}"
            continue
        diff = max((built[n] - whole[n]).abs().max().item() for n in whole) if built.keys() == whole.keys() else None
        out[(change, stage, unit)] = diff, kept
    return out
