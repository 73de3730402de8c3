"""Run DeepSpeed-Chat's step-1 supervised fine-tuning script, unmodified, under real DeepSpeed and
under zkit's drop-in, and compare the losses step by step and the saved weights.

    git -C <DeepSpeedExamples clone> archive HEAD applications/DeepSpeed-Chat | tar -x -C /tmp/dse
    python contrib/deepspeed_chat_sft.py --src /tmp/dse/applications/DeepSpeed-Chat
    python contrib/deepspeed_chat_sft.py --src ... --settings z3-offload --json out.json

``--src`` (or ``ZKIT_DEEPSPEED_CHAT_SRC``) is a DeepSpeed-Chat source tree (``dschat/`` and
``training/step1_supervised_finetuning/main.py``); nothing is fetched and nothing of it is copied
into this repository. Each run is ``deepspeed --num_gpus 2 --master_port P main.py ...``: the
DeepSpeed side with ``.venv-peers/bin/deepspeed`` (DeepSpeed 0.19.8), the drop-in side with
``.venv/bin/deepspeed``, both on the CPU (``DS_ACCELERATOR=cpu``, gloo), bf16, dropout off.

Only what a CPU machine without a network cannot do is replaced, before ``main.py`` runs, by a
shim that the launcher starts in its place (:data:`SHIM`): the model is a tiny OPT built from a
config and saved with ``save_pretrained`` into a folder ``--model_name_or_path`` names (the
same weights for both sides), the tokenizer is a stand-in of that vocabulary, and
``create_prompt_dataset`` gives synthetic token sequences (the same on both sides; Hugging Face
``datasets``, which ``dschat`` imports for its own data sets, is a stand-in where it is not
installed), and ``transformers.modeling_utils.no_init_weights``, which transformers 5 moved to
``transformers.initialization``, is put back where ``dschat`` imports it from. The losses
compared are the ones the script prints with ``--print_loss`` (``--compute_fp32_loss``: the loss
in fp32, every digit of it), every rank and micro-step; the saved weights are the
``pytorch_model.bin`` the script writes to ``--output_dir``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHERS = {"zkit": ROOT / ".venv" / "bin" / "deepspeed", "deepspeed": ROOT / ".venv-peers" / "bin" / "deepspeed"}
MAIN = Path("training") / "step1_supervised_finetuning" / "main.py"

#: the tiny OPT both sides train (vocabulary a multiple of 8: the script rounds it up so)
MODEL = {"vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "ffn_dim": 64,
         "max_position_embeddings": 64, "word_embed_proj_dim": 32, "bos_token_id": 2, "eos_token_id": 2,
         "pad_token_id": 1}
#: flags of every run: 2 ranks x 2 sequences of 16 tokens, 32 training sequences, dropout off
COMMON = ["--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2", "--max_seq_len", "16",
          "--learning_rate", "1e-3", "--num_train_epochs", "1", "--dtype", "bf16", "--dropout", "0.0",
          "--seed", "1234", "--print_loss", "--compute_fp32_loss", "--num_warmup_steps", "0"]
#: setting -> the script's own flags
SETTINGS = {
    "z2": ["--zero_stage", "2"],
    "z3": ["--zero_stage", "3"],
    "z2-offload": ["--zero_stage", "2", "--offload"],
    "z3-offload": ["--zero_stage", "3", "--offload"],
    "z2-lora": ["--zero_stage", "2", "--lora_dim", "4", "--only_optimize_lora"],
    "z3-lora": ["--zero_stage", "3", "--lora_dim", "4", "--only_optimize_lora"],
    "z2-gc-ga2": ["--zero_stage", "2", "--gradient_checkpointing", "--gradient_accumulation_steps", "2"],
    "z3-gc-ga2": ["--zero_stage", "3", "--gradient_checkpointing", "--gradient_accumulation_steps", "2"],
}
TRAIN_SEQUENCES, EVAL_SEQUENCES = 32, 8

#: started by the launcher in place of main.py: replaces the tokenizer and the data set, then runs main.py
SHIM = '''
import os, runpy, sys
import torch

src = os.environ["DSCHAT_SRC"]
sys.path.insert(0, src)
VOCAB, SEQ = int(os.environ["DSCHAT_VOCAB"]), int(os.environ["DSCHAT_SEQ"])
TRAIN, EVAL = int(os.environ["DSCHAT_TRAIN"]), int(os.environ["DSCHAT_EVAL"])


class Tokenizer:
    """What main.py and dschat read of a tokenizer."""
    eos_token, eos_token_id, pad_token, pad_token_id, padding_side = "</s>", 2, "<pad>", 1, "right"

    def __len__(self):
        return VOCAB

    def save_vocabulary(self, save_directory, filename_prefix=None):
        path = os.path.join(save_directory, "vocab.txt")
        with open(path, "w") as f:
            f.write("\\n".join(str(i) for i in range(VOCAB)))
        return (path,)


class Sequences(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        ids = torch.randint(3, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
        self.items = [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x} for x in ids]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def create_prompt_dataset(*args, **kwargs):
    return Sequences(TRAIN, 1), Sequences(EVAL, 2)


import importlib.util, types
if importlib.util.find_spec("datasets") is None:  # dschat imports it; only the data set replaced here uses it
    absent = types.ModuleType("datasets")
    def _absent(*args, **kwargs):
        raise RuntimeError("the runner feeds synthetic data: Hugging Face datasets is not installed")
    absent.load_dataset = absent.load_from_disk = _absent
    sys.modules["datasets"] = absent
import transformers.modeling_utils
if not hasattr(transformers.modeling_utils, "no_init_weights"):  # transformers 5 moved it; dschat imports it
    from transformers.initialization import no_init_weights
    transformers.modeling_utils.no_init_weights = no_init_weights
import dschat.utils.utils as utils
import dschat.utils.data.data_utils as data_utils
utils.load_hf_tokenizer = lambda *args, **kwargs: Tokenizer()
data_utils.create_prompt_dataset = create_prompt_dataset
main = os.path.join(src, "training", "step1_supervised_finetuning", "main.py")
sys.argv[0] = main
runpy.run_path(main, run_name="__main__")
'''

#: main.py's --print_loss line; a 0-d tensor formats as its Python float (every digit)
LOSS = re.compile(r"Epoch: (\d+), Step: (\d+), Rank: (\d+), loss = (?:tensor\()?"
                  r"([-+]?(?:nan|inf|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?))")


def build_model(python: Path, folder: Path) -> None:
    """The tiny OPT, saved where ``--model_name_or_path`` points (built once, by ``python``)."""
    code = ("import json, sys, torch, transformers\n"
            "torch.manual_seed(0)\n"
            "config = transformers.OPTConfig(**json.loads(sys.argv[2]))\n"
            "transformers.OPTForCausalLM(config).save_pretrained(sys.argv[1])\n")
    subprocess.run([str(python), "-c", code, str(folder), json.dumps(MODEL)], check=True, env=_env(),
                   capture_output=True, text=True)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TRANSFORMERS_OFFLINE="1",
               HF_HUB_OFFLINE="1", **extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(side: str, setting: str, src: Path, model: Path, work: Path, timeout: float) -> dict:
    """One run of the script: ``{"ok", "losses": {"rank:step": loss}, "weights": path, "tail"}``."""
    out = work / f"{side}-{setting}"
    out.mkdir(parents=True, exist_ok=True)
    shim = work / "dschat_shim.py"
    shim.write_text(SHIM)
    cmd = [str(LAUNCHERS[side]), "--num_gpus", "2", "--master_port", str(free_port()), str(shim),
           "--model_name_or_path", str(model), "--output_dir", str(out / "saved"),
           "--data_output_path", str(out / "data"), *COMMON, *SETTINGS[setting]]
    # the real DeepSpeed's CPU Adam, JIT-built once at `make peers`, lives in the peer environment
    # (unless TORCH_EXTENSIONS_DIR says where else)
    extensions = {}
    if side == "deepspeed" and "TORCH_EXTENSIONS_DIR" not in os.environ:
        extensions = {"TORCH_EXTENSIONS_DIR": str(ROOT / ".venv-peers" / "torch_extensions")}
    env = _env(**extensions, DSCHAT_SRC=str(src), DSCHAT_VOCAB=str(MODEL["vocab_size"]), DSCHAT_SEQ="16",
               DSCHAT_TRAIN=str(TRAIN_SEQUENCES), DSCHAT_EVAL=str(EVAL_SEQUENCES))
    # a session of its own: on a timeout the launcher's ranks go too, not only the launcher
    proc = subprocess.Popen(cmd, cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        text, code = f"{text}\ntimed out after {timeout:.0f} s", -1
    (out / "log.txt").write_text(text)
    losses = {f"{m[3]}:{int(m[1]) * 1000 + int(m[2])}": float(m[4]) for m in LOSS.finditer(text)}
    weights = out / "saved" / "pytorch_model.bin"
    ok = code == 0 and bool(losses) and weights.exists()
    return {"ok": ok, "losses": losses, "weights": str(weights), "tail": "\n".join(text.splitlines()[-25:])}


def weight_difference(a: str, b: str) -> float:
    """The largest absolute difference between two saved state dicts (inf when their keys or shapes differ)."""
    import torch

    sa, sb = torch.load(a, map_location="cpu"), torch.load(b, map_location="cpu")
    if sa.keys() != sb.keys() or any(sa[k].shape != sb[k].shape for k in sa):
        return float("inf")
    return max(((sa[k].float() - sb[k].float()).abs().max().item() for k in sa if sa[k].numel()), default=0.0)


def compare(zkit: dict, deepspeed: dict) -> dict:
    """Both runs' verdicts with the largest loss difference over every rank and micro-step and the
    largest saved-weight difference (None where a side did not finish)."""
    row = {"zkit": zkit["ok"], "deepspeed": deepspeed["ok"], "steps": len(zkit["losses"]), "loss": None,
           "weights": None}
    if zkit["ok"] and deepspeed["ok"]:
        if zkit["losses"].keys() != deepspeed["losses"].keys():
            row["loss"] = float("inf")
        else:
            row["loss"] = max(abs(zkit["losses"][k] - deepspeed["losses"][k]) for k in zkit["losses"])
        row["weights"] = weight_difference(zkit["weights"], deepspeed["weights"])
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", default=os.environ.get("ZKIT_DEEPSPEED_CHAT_SRC"),
                        help="a DeepSpeed-Chat source tree (default: $ZKIT_DEEPSPEED_CHAT_SRC)")
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--side", choices=["zkit", "deepspeed", "both"], default="both")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--work", help="keep the runs' folders here (default: a temporary folder)")
    parser.add_argument("--json", help="also write the table here")
    args = parser.parse_args(argv)
    if not args.src or not (Path(args.src) / MAIN).is_file():
        parser.error(f"--src (or ZKIT_DEEPSPEED_CHAT_SRC) must name a DeepSpeed-Chat source tree holding {MAIN}")
    src = Path(args.src).resolve()
    sides = ["zkit", "deepspeed"] if args.side == "both" else [args.side]
    for side in sides:
        if not LAUNCHERS[side].exists():
            parser.error(f"{LAUNCHERS[side]} is missing (`make setup` / `make peers` builds it)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work).resolve() if args.work else Path(tmp)
        model = work / "tiny-opt"
        build_model(LAUNCHERS[sides[0]].with_name("python"), model)
        table = {}
        print(f"{'setting':12} " + " ".join(f"{s:>9}" for s in sides) + f" {'steps':>5} {'max |dloss|':>12} "
              f"{'max |dweight|':>13}")
        for setting in args.settings:
            runs = {side: run(side, setting, src, model, work, args.timeout) for side in sides}
            if len(sides) == 2:
                row = compare(runs["zkit"], runs["deepspeed"])
            else:
                row = {sides[0]: runs[sides[0]]["ok"], "steps": len(runs[sides[0]]["losses"]), "loss": None,
                       "weights": None}
            table[setting] = row
            fmt = (lambda v: "-" if v is None else f"{v:.3g}")
            print(f"{setting:12} " + " ".join(f"{'runs' if row[s] else 'FAILS':>9}" for s in sides)
                  + f" {row['steps']:>5} {fmt(row['loss']):>12} {fmt(row['weights']):>13}", flush=True)
            for side in sides:
                if not runs[side]["ok"]:
                    print(f"    {side}:\n" + "\n".join("      " + line for line in runs[side]["tail"].splitlines()))
        if args.json:
            Path(args.json).write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
