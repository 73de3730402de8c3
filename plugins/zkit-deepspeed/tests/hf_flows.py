"""Hugging Face flows that ``import deepspeed``: the Trainer and an Accelerate loop.

Run on 2 ranks, unmodified, against whichever ``deepspeed`` is installed (this drop-in or the real
DeepSpeed), so that the two can be compared loss for loss:

    torchrun --nproc_per_node 2 hf_flows.py --out DIR trainer:gpt2:0 trainer:bert:3 accelerate:gpt2:2

Each flow is ``KIND:MODEL:STAGE``; the results (losses per step, the weights ``save_model`` wrote)
go to ``DIR/results.json`` from rank 0. The models are tiny configurations built here (no
downloads), dropout off, fp32, so both implementations do the same arithmetic.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch

VOCAB, SEQ, SAMPLES = 96, 16, 32
STEPS, SAVE_AT = 4, 2  # optimizer steps per run; a Trainer checkpoint after SAVE_AT of them
MICRO, ACCUM = 2, 2


def tiny_config(name: str):
    if name == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if name == "bert":
        from transformers import BertConfig

        return BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
    raise ValueError(f"unknown model {name!r}: gpt2 or bert")


def model_class(name: str):
    from transformers import BertForMaskedLM, GPT2LMHeadModel

    return {"gpt2": GPT2LMHeadModel, "bert": BertForMaskedLM}[name]


class Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences; BERT-style rows hide the label of every third token."""

    def __init__(self, masked: bool) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
        self.labels = self.ids.clone()
        if masked:
            self.labels[:, 1::3] = -100

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def save_initial_weights(name: str, path: Path) -> None:
    """The pretrained checkpoint every run starts from: built once by rank 0, without DeepSpeed (no
    process group exists yet: the others wait for the directory to appear)."""
    if int(os.environ.get("RANK", "0")) == 0 and not path.exists():
        torch.manual_seed(0)
        partial = path.with_name(path.name + ".partial")
        model_class(name)(tiny_config(name)).save_pretrained(partial)
        partial.rename(path)
    deadline = time.monotonic() + 120
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not write {path}")
        time.sleep(0.1)


def ds_config(stage: int, own_optimizer: bool = False) -> dict:
    """A config in the style of transformers' examples: everything the Trainer knows is "auto".
    ``own_optimizer``: no optimizer and scheduler sections, so the Trainer builds its own (AdamW
    with weight decay off for biases and norms, a linear schedule) and hands them over."""
    zero: dict = {"stage": stage, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto",
                    stage3_gather_16bit_weights_on_model_save=True)
    # No "train_batch_size": "auto": transformers 5.x fills it in TrainingArguments.__post_init__,
    # before it knows the world size (1 * micro * accumulation), and both DeepSpeeds then refuse
    # the config at 2 ranks; left out, it is derived from the other two.
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto",
                                                          "total_num_steps": "auto"}},
        "zero_optimization": zero,
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
    }
    if own_optimizer:
        del config["optimizer"], config["scheduler"]
    return config


def trainer_flow(name: str, stage: int, work: Path, own_optimizer: bool = False) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Losses(TrainerCallback):
        def __init__(self) -> None:
            self.logs: dict[int, tuple[float, float, float | None]] = {}

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.logs[state.global_step] = (float(logs["loss"]), float(logs["learning_rate"]),
                                                logs.get("grad_norm"))

    out = work / f"trainer{'-own' if own_optimizer else ''}-{name}-{stage}"
    # The config goes in as a dict at stages 0 and 3 and as a JSON file at stage 2: both are documented.
    config: dict | str = ds_config(stage, own_optimizer)
    if stage == 2:
        path = out.with_name(out.name + ".json")
        if int(os.environ["RANK"]) == 0:
            path.write_text(json.dumps(config))
        torch.distributed.barrier()
        config = str(path)

    def run(resume: str | None) -> list[tuple[float, float, float | None]]:
        from accelerate import PartialState
        from accelerate.state import AcceleratorState

        # Accelerate detects GPU backends only: on a CPU machine the process group's backend is
        # named by configuring the state first (what `accelerate launch --use_deepspeed` plus
        # InitProcessGroupKwargs(backend="gloo") do); otherwise every rank trains as world size 1.
        AcceleratorState._reset_state(reset_partial_state=True)
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        args = TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
            max_steps=STEPS, learning_rate=2e-3, weight_decay=0.01, adam_beta2=0.99, adam_epsilon=1e-7,
            warmup_steps=2, max_grad_norm=0.5, logging_steps=1, save_strategy="steps", save_steps=SAVE_AT,
            report_to=[], deepspeed=config, seed=0, disable_tqdm=True,
            accelerator_config={"use_configured_state": True},
        )
        # Built after TrainingArguments, as in transformers' examples: at stage 3 from_pretrained
        # constructs the model inside zero.Init and loads the weights into the partitions.
        model = model_class(name).from_pretrained(work / f"init-{name}")
        callback = Losses()
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(masked=name == "bert"),
                          callbacks=[callback])
        assert args.world_size == 2 and trainer.accelerator.distributed_type == "DEEPSPEED", args.world_size
        trainer.train(resume_from_checkpoint=resume)
        if resume is None:
            trainer.save_model(str(out / "final"))
        torch.distributed.barrier()
        return [callback.logs[step] for step in sorted(callback.logs)]

    first = run(None)
    resumed = run(str(out / f"checkpoint-{SAVE_AT}"))
    result = {"losses": [log[0] for log in first], "lr": [log[1] for log in first],
              "grad_norm": [log[2] for log in first], "resumed": [log[0] for log in resumed]}
    if int(os.environ["RANK"]) == 0:
        result["saved"] = saved_weights(out / "final")
    return result


def saved_weights(path: Path) -> dict[str, float]:
    """What ``save_model`` wrote, summarised per tensor (sum and sum of squares)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    return {k: [float(v.double().sum()), float(v.double().pow(2).sum())] for k, v in sorted(tensors.items())}


def accelerate_flow(name: str, stage: int, work: Path, launched: bool = False) -> dict:
    """The loop from Accelerate's DeepSpeed guide: a client AdamW and scheduler, ``accumulate``.
    ``launched``: started by ``accelerate launch --use_deepspeed --zero_stage N``, which configures
    the plugin from its flags; otherwise the script builds ``DeepSpeedPlugin`` itself."""
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.state import AcceleratorState
    from accelerate.utils import InitProcessGroupKwargs, set_seed

    # Accelerate detects GPU process-group backends only: on a CPU machine name gloo.
    gloo = [InitProcessGroupKwargs(backend="gloo")]
    if launched:
        accelerator = Accelerator(kwargs_handlers=gloo)
        assert accelerator.state.deepspeed_plugin.zero_stage == stage, accelerator.state
    else:
        # The Trainers before it left their state behind (transformers' tests reset it the same way).
        AcceleratorState._reset_state(reset_partial_state=True)
        config = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": ACCUM,
            "gradient_clipping": 0.5,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto",
                                  **({"stage3_gather_16bit_weights_on_model_save": True} if stage == 3 else {})},
        }
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config),
                                  gradient_accumulation_steps=ACCUM, kwargs_handlers=gloo)
    assert accelerator.distributed_type == "DEEPSPEED" and accelerator.num_processes == 2, accelerator.state
    set_seed(0)
    model = model_class(name).from_pretrained(work / f"init-{name}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    loader = torch.utils.data.DataLoader(Tokens(masked=name == "bert"), batch_size=MICRO, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses = []
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(float(mean) / torch.distributed.get_world_size())
        if len(losses) == STEPS * ACCUM:
            break
    state = accelerator.get_state_dict(model)  # the 16-bit consolidation at stage 3
    result = {"losses": losses}
    if accelerator.is_main_process:
        result["saved"] = {k: [float(v.double().sum()), float(v.double().pow(2).sum())]
                           for k, v in sorted(state.items())}
    accelerator.free_memory()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("flows", nargs="+", help="KIND:MODEL:STAGE; KIND trainer, trainer_own (the Trainer's "
                                            "optimizer), accelerate, or launch (a script "
                                            "started by `accelerate launch --use_deepspeed --zero_stage STAGE`)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    args.out.mkdir(parents=True, exist_ok=True)
    for name in sorted({flow.split(":")[1] for flow in args.flows}):
        save_initial_weights(name, args.out / f"init-{name}")
    results = {}
    for flow in args.flows:
        kind, name, stage = flow.split(":")
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        run = {"trainer": trainer_flow, "trainer_own": partial(trainer_flow, own_optimizer=True),
               "accelerate": accelerate_flow,
               "launch": partial(accelerate_flow, launched=True)}[kind]
        results[flow] = run(name, int(stage), args.out)
        if rank == 0:
            print(f"{flow}: {results[flow]['losses']}", flush=True)
    if rank == 0:
        import deepspeed

        results["deepspeed"] = {"version": deepspeed.__version__, "file": deepspeed.__file__}
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
