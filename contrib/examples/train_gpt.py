"""Train a small byte-level GPT on Jane Austen's novels with zkit.

    zkit run --nproc 2 contrib/examples/train_gpt.py --config contrib/examples/configs/gpt_zero0.json --steps 200

(``zkit run`` is torchrun; ``torchrun --nproc-per-node 2 ...`` works the same, and a plain
``python contrib/examples/train_gpt.py`` trains on one process.) Rank 0 shows a progress bar; the
engine logs loss, throughput and memory every ``steps_per_print`` steps and writes them to
``runs/<job_name>/metrics.csv``. At the end the script reports the validation loss, greedy-decodes a
continuation of a prompt, prints communication and memory per rank and saves a checkpoint.

Any config under ``configs/`` works with the same script: the ZeRO stage, optimizer and schedule
are the config's business, not the training loop's.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time

import torch
import torch.distributed as dist

import zkit
import zkit.zero
from zkit.data import ByteTextDataset, decode, encode
from zkit.models import GPT, GPTConfig
from zkit.models.gpt import PRESETS
from zkit import telemetry
from zkit.telemetry import ProgressBar, ProgressBarLogHandler, format_bytes, write_line

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DATA = os.path.join(HERE, "data", "austen.txt.gz")
DEFAULT_CONFIG = os.path.join(HERE, "configs", "gpt_zero0.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=DEFAULT_CONFIG, help="DeepSpeed-style JSON config")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (the LR schedule spans them)")
    p.add_argument("--preset", default="mini", choices=sorted(PRESETS), help="model size")
    p.add_argument("--seq-len", type=int, default=None, help="context length (default: the preset's)")
    p.add_argument("--attention", default="dense", help="attention implementation (dense, block_sparse, ...)")
    p.add_argument("--data", default=DEFAULT_DATA, help="text corpus (.txt or .txt.gz)")
    p.add_argument("--eval-batches", type=int, default=8, help="validation micro-batches per rank")
    p.add_argument("--prompt", default="It is a truth universally acknowledged", help="text to continue")
    p.add_argument("--sample-bytes", type=int, default=200, help="bytes to generate at the end")
    p.add_argument("--save-dir", default=None, help="checkpoint directory (default: runs/<job>/checkpoints)")
    p.add_argument("--no-save", action="store_true", help="do not save a checkpoint at the end")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    return args


def load_config(path: str, steps: int) -> dict:
    """The JSON config, with the LR schedule stretched over ``steps`` optimizer steps."""
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    params = (config.get("scheduler") or {}).get("params")
    if params is not None and "total_num_steps" in params:
        params["total_num_steps"] = steps
        if params.get("warmup_num_steps", 0) > steps:
            params["warmup_num_steps"] = steps
    return config


def param_groups(model: torch.nn.Module) -> list[dict]:
    """Weight decay on matrices (the embedding included) only, not on biases and LayerNorms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def batches(loader: torch.utils.data.DataLoader):
    """The loader's batches forever, reshuffled every epoch."""
    epoch = 0
    while True:
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


@torch.no_grad()
def validation_loss(engine, dataset: ByteTextDataset, batches_per_rank: int) -> float:
    """Mean loss over the first ``batches_per_rank * world`` validation micro-batches, each rank
    taking every world-th one."""
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = engine.train_micro_batch_size_per_gpu()
    total = torch.zeros(2, dtype=torch.float64)
    engine.eval()
    for b in range(rank, batches_per_rank * world, world):
        idx = [i % len(dataset) for i in range(b * micro, (b + 1) * micro)]
        x = torch.stack([dataset[i][0] for i in idx]).to(engine.device)
        y = torch.stack([dataset[i][1] for i in idx]).to(engine.device)
        total += torch.tensor([engine(x, y).item(), 1.0], dtype=torch.float64)
    engine.train()
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = load_config(args.config, args.steps)
    torch.manual_seed(config.get("seed", 1234))  # the same initial weights on every rank

    overrides = {"attention": args.attention}
    if args.seq_len is not None:
        overrides["seq_len"] = args.seq_len
    model_config = GPTConfig.preset(args.preset, **overrides)
    model = GPT(model_config)
    train_data = ByteTextDataset(args.data, model_config.seq_len, split="train")
    val_data = ByteTextDataset(args.data, model_config.seq_len, split="val")

    engine, _optimizer, loader, _lr_scheduler = zkit.initialize(
        model=model, config=config, model_parameters=param_groups(model), training_data=train_data
    )
    engine.tokens_per_sample = model_config.seq_len
    rank, world = engine.rank, engine.world_size
    main_rank = rank == 0
    logger = logging.getLogger("zkit")
    if main_rank and not logger.handlers:
        handler = ProgressBarLogHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    say = (lambda line: write_line(line, sys.stdout)) if main_rank else (lambda line: None)

    gas = engine.gradient_accumulation_steps()
    say(
        f"zkit {zkit.__version__}: GPT '{args.preset}' {model.num_parameters():,} parameters, "
        f"{world} rank(s), micro-batch {engine.train_micro_batch_size_per_gpu()} x {gas} accumulation x "
        f"{world} ranks = {engine.train_batch_size()} sequences of {model_config.seq_len} bytes per step"
    )
    say(f"data: {train_data!r}")

    data = batches(loader)
    bar = ProgressBar(args.steps, desc="train", enabled=main_rank)
    first_loss = None
    recent: list[float] = []
    started = time.perf_counter()
    while engine.global_steps < args.steps:
        losses = []
        for _ in range(gas):
            input_ids, labels = (t.to(engine.device) for t in next(data))
            loss = engine(input_ids, labels)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        step_loss = sum(losses) / len(losses)
        first_loss = step_loss if first_loss is None else first_loss
        recent = (recent + [step_loss])[-10:]
        bar.update(1, loss=step_loss, lr=engine.get_lr()[0])
    bar.close()
    train_time = time.perf_counter() - started

    val_loss = validation_loss(engine, val_data, args.eval_batches)
    prompt = encode(args.prompt)[None].to(engine.device)
    # Every rank generates (greedy, or sampled from one seed, so identically); under ZeRO stage 3 the
    # parameters are gathered for it (a no-op for stages 0-2).
    with zkit.zero.GatheredParameters(list(engine.module.parameters())):
        sample = engine.module.generate(prompt, args.sample_bytes)[0, prompt.shape[1] :]
        sampled = engine.module.generate(
            prompt, args.sample_bytes, temperature=0.8, top_k=20, generator=torch.Generator(prompt.device).manual_seed(0)
        )[0, prompt.shape[1] :]
    engine.monitor.write_events([("Eval/loss", val_loss, engine.global_steps)])
    tokens = telemetry.of(engine).throughput.total_tokens
    say(
        f"trained {engine.global_steps} steps in {train_time:.0f} s ({tokens / train_time:,.0f} tokens/s): "
        f"loss {first_loss:.3f} (first step) -> {sum(recent) / len(recent):.3f} (mean of last {len(recent)})"
    )
    say(f"validation loss {val_loss:.3f} ({val_loss / math.log(2):.2f} bits per byte)")
    say(f"sample (greedy, {args.sample_bytes} bytes):\n\n{args.prompt}{decode(sample)}\n")
    say(f"sample (temperature 0.8, top-20, {args.sample_bytes} bytes):\n\n{args.prompt}{decode(sampled)}\n")

    comm = engine.comm_stats()
    memory = [engine.memory()]
    if world > 1:
        memory = [None] * world
        dist.all_gather_object(memory, engine.memory())
    say("communication (rank 0): " + ", ".join(f"{k} {v['calls']} calls {format_bytes(v['bytes'])}" for k, v in comm.items()))
    for r, mem in enumerate(memory):
        say(f"memory rank {r}: " + ", ".join(f"{k.removesuffix('_bytes')} {format_bytes(v)}" for k, v in mem.items()))

    if not args.no_save:
        job = (config.get("csv_monitor") or {}).get("job_name", "gpt")
        save_dir = args.save_dir or os.path.join("runs", job, "checkpoints")
        path = engine.save_checkpoint(save_dir)
        say(f"checkpoint saved: {path}")
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
