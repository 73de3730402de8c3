"""PyTorch Lightning's ``DeepSpeedStrategy``, stock, on whichever ``deepspeed`` this interpreter
imports (zkit's drop-in in ``.venv``, the real DeepSpeed in ``.venv-peers``):

    python lightning_flow.py --out DIR deepspeed_stage_2 deepspeed_stage_3 deepspeed_stage_3_offload

For every strategy name: train 3 steps, ``trainer.save_checkpoint``, resume from it in a new
Trainer for 2 more steps, and convert the checkpoint with Lightning's
``convert_zero_checkpoint_to_fp32_state_dict``. ``DIR/results.json`` holds every step's loss, the
converted weights (as lists) and the client state Lightning kept. One CPU process, fp32.

Lightning accepts this strategy on CUDA accelerators only; the subclass below skips that check and
nothing else, and the device is named ``cpu:0`` (with an index, as a GPU is), so everything DeepSpeed
sees is Lightning's own.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch

STEPS, MORE = 3, 2
#: a device index, as a GPU's: DeepSpeed reads it (``args.device_rank``), Lightning checks it against the local rank
CPU0 = torch.device("cpu", 0)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("flows", nargs="+")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    torch.set_num_threads(1)

    import deepspeed
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        """The accelerator check (CUDA only) skipped."""

        def setup_environment(self) -> None:
            super(DeepSpeedStrategy, self).setup_environment()

    class Net(pl.LightningModule):
        def __init__(self, offload: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
            self.offload = offload
            self.losses: list[float] = []

        def training_step(self, batch, _index):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layers(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            if self.offload:  # what DeepSpeed wants with offload_optimizer (a client torch optimizer is refused)
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                return DeepSpeedCPUAdam(self.parameters(), lr=1e-2)
            return torch.optim.Adam(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            x = torch.randn(4 * (STEPS + MORE), 6, generator=g)
            data = torch.utils.data.TensorDataset(x, torch.stack([x.sum(1), x[:, 0]], 1) * 0.3)
            return torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)

    def trainer(name: str, steps: int) -> pl.Trainer:
        settings = dict(StrategyRegistry[name]["init_params"])
        return pl.Trainer(accelerator="cpu", devices=1, strategy=CPUDeepSpeedStrategy(**settings, parallel_devices=[CPU0]), max_steps=steps,
                          logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0)

    results = {"deepspeed": deepspeed.__version__}
    for name in args.flows:
        offload = name.endswith("offload")
        model = Net(offload)
        first = trainer(name, STEPS)
        first.fit(model)
        ckpt = out / f"{name}.ckpt"
        first.save_checkpoint(ckpt)
        resumed = Net(offload)
        second = trainer(name, STEPS + MORE)
        second.fit(resumed, ckpt_path=ckpt)
        converted = convert_zero_checkpoint_to_fp32_state_dict(ckpt, out / f"{name}.fp32.pt")
        results[name] = {
            "losses": model.losses, "resumed": resumed.losses,
            "weights": {k: v.tolist() for k, v in converted["state_dict"].items()},
            "global_step": converted.get("global_step"), "epoch": converted.get("epoch"),
            "client_keys": sorted(k for k in converted if k != "state_dict"),
        }
    (out / "results.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
