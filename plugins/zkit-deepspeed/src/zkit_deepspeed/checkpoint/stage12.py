"""ZeRO stages 1 and 2: one flat fp32 vector per parameter group, cut into equal partitions.

DeepSpeed flattens each parameter group's trainable parameters in ``param_shapes`` order (its
round-robin order), each followed by ``param_alignment_paddings[g][i]`` elements of padding, pads
the whole to a multiple of the alignment times the world size and gives data-parallel rank ``r``
the elements ``[r * P, (r + 1) * P)``. Its file holds that partition of the fp32 master weights
(``single_partition_of_fp32_groups``, the padding at the end cut off: ``group_paddings`` says how
much) and the optimizer state of the whole partition (``base_optimizer_state``). So a parameter's
element range on a rank follows from the shapes, the paddings and ``P``, which rank 0's file gives
(its kept length plus its padding)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import torch

from zkit.core.checkpoint_errors import CheckpointError


@attrs.frozen
class FlatGroup:
    """One parameter group as DeepSpeed flattened it."""

    #: ``(name, numel, offset)`` of every parameter, in flattening order
    params: tuple[tuple[str, int, int], ...]
    #: elements of each rank's partition
    partition: int

    def ranges(self, rank: int) -> list[tuple[str, int, int, int]]:
        """``(name, start, end, offset)``: the element ranges of parameters rank ``rank`` holds,
        ``offset`` being where ``start`` sits in its partition."""
        lo, hi = rank * self.partition, (rank + 1) * self.partition
        out = []
        for name, numel, offset in self.params:
            a, b = max(lo, offset), min(hi, offset + numel)
            if a < b:
                out.append((name, a - offset, b - offset, a - lo))
        return out


def flat_groups(param_shapes: list[dict[str, Any]], first_optim: dict[str, Any], where: Path) -> list[FlatGroup]:
    """The flattening of every group, from the model file's ``param_shapes`` and rank 0's optimizer state."""
    kept = first_optim["single_partition_of_fp32_groups"]
    paddings = first_optim.get("group_paddings", [0] * len(kept))
    alignment = first_optim.get("param_alignment_paddings")
    if len(kept) != len(param_shapes):
        raise CheckpointError(
            f"{where}: {len(param_shapes)} parameter groups in param_shapes but {len(kept)} in the optimizer files"
        )
    groups = []
    for g, shapes in enumerate(param_shapes):
        pads = alignment[g] if alignment is not None else [0] * len(shapes)
        if len(pads) != len(shapes):
            raise CheckpointError(f"{where}: group {g} has {len(shapes)} parameters but {len(pads)} alignment paddings")
        params, offset = [], 0
        for (name, shape), pad in zip(shapes.items(), pads):
            numel = math.prod(shape)
            params.append((name, numel, offset))
            offset += numel + int(pad)
        groups.append(FlatGroup(params=tuple(params), partition=int(kept[g].numel()) + int(paddings[g])))
    return groups


def index(groups: list[FlatGroup], world_size: int) -> list[list[tuple[str, int, int]]]:
    """For every rank, the ``(name, start, end)`` ranges its file holds."""
    return [[(n, s, e) for g in groups for n, s, e, _ in g.ranges(rank)] for rank in range(world_size)]


def pieces(groups: list[FlatGroup], rank: int, optim: dict[str, Any], with_state: bool, path: Path) -> list[dict[str, Any]]:
    """Rank ``rank``'s saved pieces, as zkit's rank files hold them (views, no copies)."""
    kept = optim["single_partition_of_fp32_groups"]
    states = _group_states(optim, len(groups), path) if with_state else [{}] * len(groups)
    out = []
    for g, group in enumerate(groups):
        master = kept[g].reshape(-1)
        for name, start, end, offset in group.ranges(rank):
            if offset + end - start > master.numel():
                raise CheckpointError(
                    f"{path}: group {g} holds {master.numel()} elements, too few for {name}[{start}:{end}] "
                    f"at {offset} (is the file from another save?)"
                )
            out.append({
                "name": name, "start": start, "end": end,
                "master": master[offset:offset + end - start].detach(),
                "state": slice_state(states[g], offset, end - start),
            })
    return out


def _group_states(optim: dict[str, Any], groups: int, path: Path) -> list[dict[str, Any]]:
    base = optim.get("base_optimizer_state")
    if isinstance(base, list):  # elastic checkpoints: one lean state per group, the step apart
        step = optim.get("base_optimizer_state_step")
        return [dict(s, **({"step": step} if step is not None and "step" not in s else {})) for s in base]
    if not isinstance(base, dict) or "state" not in base:
        raise CheckpointError(f"{path}: no base_optimizer_state in the ZeRO optimizer file")
    state = base["state"]
    return [state.get(g, {}) for g in range(groups)]


def slice_state(state: dict[str, Any], offset: int, numel: int) -> dict[str, Any]:
    """The optimizer state of ``numel`` elements at ``offset`` of a flat partition; the step as the
    float32 tensor torch's optimizers keep."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0:
            out[key] = value.detach().reshape(-1)[offset:offset + numel]
        elif key == "step":
            out[key] = torch.tensor(float(value), dtype=torch.float32, device="cpu")
        else:
            out[key] = value
    return out
