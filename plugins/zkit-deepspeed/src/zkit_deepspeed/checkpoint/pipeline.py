"""A DeepSpeed ``PipelineModule`` checkpoint, read as one model.

DeepSpeed's pipeline engine writes, in one tag's directory:

- ``layer_<XX>-model_states.pt``: each layer's state dict, whole, in the training dtype;
- for every stage ``s``: ``mp_rank_<s>_model_states.pt`` (counters, LR scheduler, client state and
  the stage's ``param_shapes``) and, with ZeRO stage 1 or bf16, one
  ``[bf16_]zero_pp_rank_<d>_mp_rank_<s>_optim_states.pt`` per data-parallel rank ``d``: that
  stage's fp32 masters and optimizer state, flattened and cut as for an unsplit model.

Parameter names are the ``PipelineModule``'s own: ``<layer index>.<name in the layer>`` and
``tied_modules.<key>.<name>``, the same whatever the number of stages. So each stage is read as an
unsplit checkpoint of its own parameters (:class:`DeepSpeedCheckpoint`) and the stages are joined
by name. A tied module that several stages hold is taken from the first of them: DeepSpeed keeps
the copies equal by summing their gradients over those stages.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from zkit.core.checkpoint_errors import CheckpointError
from zkit_deepspeed.checkpoint.checkpoint import DeepSpeedCheckpoint
from zkit_deepspeed.checkpoint.layout import Layout, pipeline_stages
from zkit_deepspeed.checkpoint.unpickler import load_file

_LAYER_INDEX = re.compile(r"^layer_(\d+)-")


class DeepSpeedPipelineCheckpoint:
    """The pipeline checkpoint in ``where``; the same reading interface as :class:`DeepSpeedCheckpoint`."""

    def __init__(self, where: Path, layout: Layout) -> None:
        self.where, self.layout = where, layout
        self.stages = [DeepSpeedCheckpoint(where, stage_layout) for stage_layout in pipeline_stages(where)]
        first = self.stages[0]
        self.model_state, self.first_optim = first.model_state, first.first_optim
        self.stage, self.world_size = first.stage, first.world_size
        for k, part in enumerate(self.stages[1:], 1):
            if (part.stage, part.world_size) != (self.stage, self.world_size):
                raise CheckpointError(
                    f"{where}: pipeline stage {k} was saved at ZeRO stage {part.stage} on {part.world_size} "
                    f"data-parallel ranks, stage 0 at {self.stage} on {self.world_size}: files from two saves"
                )
        #: trainable parameters: name -> shape; ``_holder``: name -> the pipeline stage it is read from
        self.params: dict[str, tuple[int, ...]] = {}
        self._holder: dict[str, int] = {}
        for k, part in enumerate(self.stages):
            for name, shape in part.params.items():
                if name not in self.params:
                    self.params[name], self._holder[name] = shape, k
                elif self.params[name] != shape:
                    raise CheckpointError(
                        f"{where}: tied parameter {name!r} has shape {self.params[name]} in stage "
                        f"{self._holder[name]}'s files but {shape} in stage {k}'s"
                    )
        self._file_stage = {fname: k for k, part in enumerate(self.stages) for fname in part.index}
        self.index: dict[str, list[list[Any]]] = {
            fname: [r for r in part.index[fname] if self._holder[r[0]] == k]
            for k, part in enumerate(self.stages)
            for fname in part.index
        }

    def pieces(self, fname: str, *, with_state: bool = True) -> list[dict[str, Any]]:
        """The saved pieces of optimizer file ``fname`` (memory-mapped views)."""
        k = self._file_stage[fname]
        return [p for p in self.stages[k].pieces(fname, with_state=with_state) if self._holder[p["name"]] == k]

    def _extra_names(self) -> set[str]:
        names: set[str] = set()
        for part in self.stages:
            names |= set(part.model_state.get("buffer_names") or [])
            names |= set(part.model_state.get("frozen_param_shapes") or {})
        return names

    def module_extras(self) -> dict[str, torch.Tensor]:
        """Buffers and frozen parameters of the layers, by name, from the layer files."""
        wanted, out = self._extra_names(), {}
        for path in self.layout.layer_files:
            index = int(_LAYER_INDEX.match(path.name).group(1))
            state = load_file(path)
            if not isinstance(state, dict):
                raise CheckpointError(f"{path}: expected a layer's state dict, found {type(state).__name__}")
            out.update({f"{index}.{n}": t for n, t in state.items() if f"{index}.{n}" in wanted})
        return out

    @property
    def aliases(self) -> dict[str, str]:
        return {}

    def state_dict_keys(self) -> list[str]:
        """The whole ``PipelineModule``'s state dict keys: tied modules first, then layer by layer."""
        extras = sorted(self._extra_names())
        keys = list(self.params) + [n for n in extras if n not in self.params]

        def order(name: str) -> tuple[int, int]:
            head = name.split(".", 1)[0]
            return (0, 0) if not head.isdigit() else (1, int(head))

        return sorted(keys, key=order)

    def client_state(self, *, with_optimizer: bool, with_lr_scheduler: bool) -> dict[str, Any]:
        return self.stages[0].client_state(with_optimizer=with_optimizer, with_lr_scheduler=with_lr_scheduler)

    def loss_scaler(self) -> dict[str, Any]:
        return self.stages[0].loss_scaler()

    def param_groups(self) -> list[dict[str, Any]]:
        return self.stages[0].param_groups()


class StageView:
    """What one rank of a split model holds of a pipeline checkpoint, under that rank's names
    (``names``: ``{name here: name in the checkpoint}``, from :meth:`LayerNamed.layer_names`)."""

    def __init__(self, ckpt: DeepSpeedPipelineCheckpoint, names: dict[str, str]) -> None:
        self.ckpt = ckpt
        self.model_state, self.stage, self.world_size = ckpt.model_state, ckpt.stage, ckpt.world_size
        self._ours = {theirs: ours for ours, theirs in names.items()}
        self.params = {self._ours[n]: shape for n, shape in ckpt.params.items() if n in self._ours}
        #: the checkpoint's names of the parameters read here
        self.read = {n for n in ckpt.params if n in self._ours}
        self.index = {
            fname: [[self._ours[n], s, e] for n, s, e in ranges if n in self._ours]
            for fname, ranges in ckpt.index.items()
        }

    def pieces(self, fname: str, *, with_state: bool = True) -> list[dict[str, Any]]:
        return [dict(p, name=self._ours[p["name"]]) for p in self.ckpt.pieces(fname, with_state=with_state)
                if p["name"] in self._ours]

    def module_extras(self) -> dict[str, torch.Tensor]:
        return {self._ours[n]: t for n, t in self.ckpt.module_extras().items() if n in self._ours}

    def client_state(self, *, with_optimizer: bool, with_lr_scheduler: bool) -> dict[str, Any]:
        return self.ckpt.client_state(with_optimizer=with_optimizer, with_lr_scheduler=with_lr_scheduler)

    def loss_scaler(self) -> dict[str, Any]:
        return self.ckpt.loss_scaler()

    def param_groups(self) -> list[dict[str, Any]]:
        return self.ckpt.param_groups()
