"""One DeepSpeed checkpoint tag, read as zkit reads its own: every data-parallel rank's optimizer
file becomes a list of *pieces* (element ranges of named parameters with their fp32 master values
and optimizer state) and an index says which file holds which ranges, so loading and
consolidating reshard it with the same code as a zkit checkpoint (:mod:`zkit.checkpoint.load`,
:mod:`zkit.checkpoint.consolidate`)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from zkit.core.checkpoint_errors import CheckpointError
from zkit_deepspeed.checkpoint import stage3, stage12
from zkit_deepspeed.checkpoint.layout import Layout, detect
from zkit_deepspeed.checkpoint.unpickler import load_file

#: what DeepSpeed's own load_checkpoint keeps out of the client state it returns
_ENGINE_KEYS = ("module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler", "random_ltd")


class DeepSpeedCheckpoint:
    """The DeepSpeed checkpoint in ``where`` (one tag's directory)."""

    def __init__(self, where: Path, layout: Layout | None = None) -> None:
        """``layout`` is given for one stage of a pipeline checkpoint (:mod:`.pipeline`), whose
        files say ``mp_world_size`` = the number of stages."""
        self.layout: Layout = layout if layout is not None else detect(where)
        self.where = where
        if layout is None and self.layout.layer_files:
            raise CheckpointError(f"{where}: a DeepSpeed PipelineModule checkpoint: read it with open_checkpoint()")
        self.model_state: dict[str, Any] = self._dict(self.layout.model_files[0])
        if layout is None and int(self.model_state.get("mp_world_size", 1) or 1) > 1:
            raise CheckpointError(
                f"{self.layout.model_files[0]}: written with model-parallel degree {self.model_state['mp_world_size']}; "
                f"importing tensor-parallel checkpoints is not supported"
            )
        if not self.layout.optim_files:
            raise CheckpointError(
                f"{where}: no zero_pp_rank_*_optim_states.pt files: a DeepSpeed checkpoint without ZeRO (stage 0); "
                f"only ZeRO stages 1-3 checkpoints can be imported"
            )
        self.first_optim = self._optimizer(0)
        # DeepSpeed's BF16_Optimizer (bf16 without ZeRO) records no stage; its files are laid out as stage 1's
        bf16_optimizer = "zero_stage" not in self.first_optim and "single_partition_of_fp32_groups" in self.first_optim
        self.stage = 1 if bf16_optimizer else int(self.first_optim.get("zero_stage", 0))
        count = self.first_optim.get("partition_count")
        self.world_size = max(count) if isinstance(count, list) else int(count)
        if self.world_size != len(self.layout.optim_files):
            raise CheckpointError(
                f"{where}: written by {self.world_size} data-parallel ranks but {len(self.layout.optim_files)} "
                f"optimizer files are there (a save that did not finish, or files from two saves)"
            )
        param_shapes = self.model_state.get("param_shapes")
        if not isinstance(param_shapes, list) and bf16_optimizer:
            raise CheckpointError(
                f"{where}: written by DeepSpeed's bf16 optimizer without ZeRO (stage 0), whose files do not "
                f"record the parameters' names and shapes; only ZeRO stages 1-3 checkpoints can be imported"
            )
        if not isinstance(param_shapes, list):
            raise CheckpointError(f"{self.layout.model_files[0]}: no param_shapes: not a ZeRO checkpoint's model file")
        #: trainable parameters in flattening order: name -> shape
        self.params: dict[str, tuple[int, ...]] = {n: tuple(s) for g in param_shapes for n, s in g.items()}
        if self.stage in (1, 2):
            self._groups = stage12.flat_groups(param_shapes, self.first_optim, self.layout.optim_files[0])
            ranges = stage12.index(self._groups, self.world_size)
        elif self.stage == 3:
            self._slices = stage3.Slices.of(param_shapes, self.world_size)
            ranges = stage3.index(self._slices)
        else:
            raise CheckpointError(f"{self.layout.optim_files[0]}: ZeRO stage {self.stage} optimizer file is not supported")
        #: file name -> the (name, start, end) ranges it holds, as in zkit's metadata
        self.index: dict[str, list[list[Any]]] = {
            f.name: [[n, s, e] for n, s, e in r] for f, r in zip(self.layout.optim_files, ranges)
        }

    # -- files --------------------------------------------------------------------------------------
    def _dict(self, path: Path) -> dict[str, Any]:
        data = load_file(path)
        if not isinstance(data, dict):
            raise CheckpointError(f"{path}: expected a dict, found {type(data).__name__}")
        return data

    def _optimizer(self, rank: int) -> dict[str, Any]:
        path = self.layout.optim_files[rank]
        osd = self._dict(path).get("optimizer_state_dict")
        if not isinstance(osd, dict):
            raise CheckpointError(f"{path}: no optimizer_state_dict: not a ZeRO optimizer file")
        return osd

    def pieces(self, fname: str, *, with_state: bool = True) -> list[dict[str, Any]]:
        """The saved pieces of optimizer file ``fname`` (memory-mapped views)."""
        rank = [f.name for f in self.layout.optim_files].index(fname)
        optim = self._optimizer(rank)  # mapped afresh: dropping the pieces unmaps what they touched
        path = self.layout.optim_files[rank]
        if self.stage == 3:
            return stage3.pieces(self._slices, rank, optim, with_state, path)
        return stage12.pieces(self._groups, rank, optim, with_state, path)

    # -- the rest of the model ------------------------------------------------------------------------
    def module_extras(self) -> dict[str, torch.Tensor]:
        """Buffers and frozen parameters (whole), by name (the model file mapped afresh)."""
        state = self._dict(self.layout.model_files[0])
        module = state.get("module") or {}
        names = list(state.get("buffer_names") or [])
        out = {n: module[n] for n in names if n in module}
        frozen = state.get("frozen_param_shapes") or {}
        if frozen and self.stage == 3:  # partitioned like the trainable ones, one fragment per rank file
            states = [state] + [self._dict(p) for p in self.layout.model_files[1:]]
            for name, shape in frozen.items():
                flat = torch.cat([s["frozen_param_fragments"][name].reshape(-1) for s in states])
                out[name] = flat[: math.prod(shape)].view(tuple(shape))
        else:
            fragments = state.get("frozen_param_fragments") or {}
            for name in frozen:
                out[name] = fragments[name] if name in fragments else module[name]
        if not frozen:  # older saves: frozen parameters only in the module state dict
            out.update({n: t for n, t in module.items() if n not in self.params and n not in out and n not in self.aliases})
        return out

    @property
    def aliases(self) -> dict[str, str]:
        """``{alias: canonical}`` of tied parameters (DeepSpeed's ``shared_params``)."""
        return dict(self.model_state.get("shared_params") or {})

    def state_dict_keys(self) -> list[str]:
        """The module's state dict keys in order (every trainable parameter, alias and buffer)."""
        keys = list(self.model_state.get("module") or {})
        missing = [n for n in self.params if n not in keys]
        return keys + missing

    def client_state(self, *, with_optimizer: bool, with_lr_scheduler: bool) -> dict[str, Any]:
        """What DeepSpeed's ``load_checkpoint`` returns as client state: every top-level entry of
        the model file that is not the engine's own."""
        skip = set(_ENGINE_KEYS) | ({"optimizer"} if with_optimizer else set()) | ({"lr_scheduler"} if with_lr_scheduler else set())
        return {k: v for k, v in self.model_state.items() if k not in skip}

    def loss_scaler(self) -> dict[str, Any]:
        """The loss scaler's state in zkit's form."""
        scaler = self.first_optim.get("loss_scaler")
        attrs_ = vars(scaler) if scaler is not None and hasattr(scaler, "__dict__") else {}
        scale = attrs_.get("cur_scale", 1.0)
        return {
            "scale": float(scale.item() if torch.is_tensor(scale) else scale),
            "iteration": int(attrs_.get("cur_iter", self.model_state.get("global_steps", 0))),
            "last_overflow": int(attrs_.get("last_overflow_iter", -1)),
            "hysteresis_left": int(attrs_.get("cur_hysteresis", attrs_.get("delayed_shift", 2))),
        }

    def param_groups(self) -> list[dict[str, Any]]:
        """The torch optimizer's param groups as saved (hyperparameters; ``params`` left out)."""
        if self.stage == 3:
            groups = self.first_optim.get("optimizer_state_dict", {}).get("param_groups", [])
        else:
            base = self.first_optim.get("base_optimizer_state")
            groups = base.get("param_groups", []) if isinstance(base, dict) else []
        return [{k: v for k, v in g.items() if k != "params"} for g in groups]

