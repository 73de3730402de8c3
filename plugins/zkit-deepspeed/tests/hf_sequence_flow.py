"""The Transformers ``Trainer`` with Ulysses sequence parallelism the Accelerate way
(``ParallelismConfig(sp_backend="deepspeed", sp_size=P)``), unmodified, on whichever ``deepspeed``
is installed (this drop-in or the real DeepSpeed), so that the two can be compared step for step:

    torchrun --nproc_per_node 2 hf_sequence_flow.py --out DIR --sp 2 --stage 2

``--sp 1`` is the same run without sequence parallelism (the reference at the same global batch:
run it on ``world / P`` ranks); with ``world / P`` above 1 the sequence groups train as that many
data-parallel replicas. A tiny Llama with grouped-query attention (4 query heads, 2
key-value heads: at 4 ranks each key-value head is repeated to one per rank), fp32, sdpa attention,
no dropout; every row masks its first 12 labels with -100 (a prompt), so at 4 ranks the first slice
has no token to learn from and the second half of one. (Every row counts as many tokens: the Trainer
averages the accumulated micro-batches' losses under sequence parallelism and weighs them by tokens
without it, which agree only then.) Rank 0 writes ``DIR/results.json``: per optimizer step the loss and the
gradient norm the Trainer logged, and what the engine says of its groups.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

VOCAB, SEQ, SAMPLES, HEADS, KV_HEADS, PROMPT = 96, 32, 16, 4, 2, 12
STEPS, MICRO, ACCUM = 4, 1, 2


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
        self.labels = self.ids.clone()
        self.labels[:, :PROMPT] = -100  # a prompt the loss does not count

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i], "position_ids": torch.arange(SEQ)}


def ds_config(stage: int, optim: str) -> dict:
    """DeepSpeed's AdamW (``adamw``, clipping at 1), or the Trainer's own optimizer (``sgd``:
    torch's SGD, whose steps show the gradients' scale; clipping at 1e9, which never clips but
    makes both engines compute the gradient norm)."""
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "zero_optimization": {"stage": stage}}
    if optim == "adamw":
        config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                           "weight_decay": "auto"}}
    else:
        config["zero_allow_untested_optimizer"] = True
    return config


def run(sp: int, stage: int, optim: str, out: Path) -> dict:
    from accelerate import PartialState
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    # Accelerate detects GPU process-group backends only: on a CPU machine name gloo first
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    torch.manual_seed(0)  # the model before the arguments: no zero.Init, the same weights everywhere
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                         max_position_embeddings=SEQ, attn_implementation="sdpa"))
    parallelism = None
    if sp > 1:
        # Accelerate counts the data-parallel replicas (for train_batch_size) from dp_replicate_size
        replicas = torch.distributed.get_world_size() // sp
        parallelism = ParallelismConfig(sp_backend="deepspeed", sp_size=sp, dp_replicate_size=replicas,
                                        sp_handler=DeepSpeedSequenceParallelConfig(
                                            sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))
    args = TrainingArguments(output_dir=str(out / "trainer"), per_device_train_batch_size=MICRO,
                             gradient_accumulation_steps=ACCUM, max_steps=STEPS, learning_rate=2e-3,
                             lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
                             deepspeed=ds_config(stage, optim), optim="adamw_torch" if optim == "adamw" else "sgd",
                             max_grad_norm=1.0 if optim == "adamw" else 1e9,
                             seed=0, disable_tqdm=True,
                             accelerator_config={"use_configured_state": True}, parallelism_config=parallelism)

    class Logs(TrainerCallback):
        steps: dict[int, tuple[float, float | None]] = {}

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                Logs.steps[state.global_step] = (float(logs["loss"]), logs.get("grad_norm"))

    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[Logs()])
    trainer.train()
    engine = trainer.model_wrapped
    steps = [Logs.steps[s] for s in sorted(Logs.steps)]
    return {"losses": [loss for loss, _ in steps], "grad_norm": [norm for _, norm in steps],
            "dp_world_size": engine.dp_world_size, "seq_dp_world_size": engine.seq_dp_world_size,
            "sequence_parallel_size": engine.sequence_parallel_size}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--sp", type=int, required=True, help="sequence-parallel ranks (1: none)")
    p.add_argument("--stage", type=int, default=2, help="ZeRO stage")
    p.add_argument("--optim", choices=("adamw", "sgd"), default="adamw")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args.sp, args.stage, args.optim, args.out)
    if int(os.environ.get("RANK", "0")) == 0:
        import deepspeed

        result["deepspeed"] = deepspeed.__version__
        (args.out / "results.json").write_text(json.dumps(result, indent=1))
        print(f"sp {args.sp} stage {args.stage} {args.optim}: {result}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
