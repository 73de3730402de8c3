"""Reading DeepSpeed's files without running their pickles.

DeepSpeed writes its checkpoint files with ``torch.save``; besides tensors and containers they hold
a few pickled Python objects: the loss scaler, the ZeRO stage enum, the fragment addresses of
``param_slice_mappings`` and, in client state written by Megatron-style scripts, an
``argparse.Namespace``. Unpickling runs whatever callable a file names, so these files are read
with ``torch.load(weights_only=True)``, torch's restricted unpickler, with exactly those names
added: each is mapped to an inert stand-in defined here (DeepSpeed need not be installed, and none
of its code runs). A file naming anything else is refused with the file and the object named.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import torch

from zkit.core.checkpoint_errors import CheckpointError


class PickledObject:
    """An object DeepSpeed pickled, its attributes restored and no behaviour: ``origin`` is the
    name it was pickled under (``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``)."""

    origin = ""

    def __repr__(self) -> str:
        return f"<{self.origin} {vars(self)}>"


class PickledIntEnum(int):
    """An ``int``-valued enum member (``ZeroStageEnum.optimizer_states`` is 1)."""

    origin = ""


class PickledStrEnum(str):
    """A ``str``-valued enum member (``OffloadDeviceEnum.cpu`` is ``"cpu"``)."""

    origin = ""


def _stand_in(base: type, origin: str) -> type:
    return type(origin.rsplit(".", 1)[1], (base,), {"origin": origin, "__module__": __name__})


_LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler"
#: every name outside torch's own that a DeepSpeed checkpoint may hold, and what it becomes
STAND_INS: dict[str, Any] = {
    **{f"{_LOSS_SCALER}.{n}": _stand_in(PickledObject, f"{_LOSS_SCALER}.{n}")
       for n in ("LossScaler", "DynamicLossScaler", "LossScalerBase")},
    "deepspeed.runtime.zero.config.ZeroStageEnum": _stand_in(PickledIntEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    **{f"deepspeed.runtime.zero.offload_config.{n}": _stand_in(PickledStrEnum, f"deepspeed.runtime.zero.offload_config.{n}")
       for n in ("OffloadDeviceEnum", "OffloadStateTypeEnum")},
    "deepspeed.utils.tensor_fragment.fragment_address": _stand_in(PickledObject, "deepspeed.utils.tensor_fragment.fragment_address"),
    "argparse.Namespace": argparse.Namespace,
}

_GLOBAL = re.compile(r"GLOBAL (\S+)")


def load_file(path: Path, *, mmap: bool = True) -> Any:
    """``torch.load`` a DeepSpeed checkpoint file on the CPU (memory-mapped by default), allowing
    only torch's safe types and :data:`STAND_INS`."""
    if not path.is_file():
        raise CheckpointError(f"{path}: DeepSpeed checkpoint file is missing")
    try:
        with torch.serialization.safe_globals([(obj, name) for name, obj in STAND_INS.items()]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - every failure names the file
        text = str(exc)
        found = _GLOBAL.search(text)
        if found or "Unsupported" in text or "unrecognized function" in text or "allowlisted" in text:
            what = found.group(1) if found else text.splitlines()[0]
            raise CheckpointError(
                f"{path}: refusing to unpickle {what}: it is not among the objects DeepSpeed checkpoints hold "
                f"(tensors, containers, {', '.join(sorted(STAND_INS))}); zkit never runs code from a checkpoint. "
                f"If the file is yours, convert it in a trusted interpreter first"
            ) from None
        raise CheckpointError(f"{path}: cannot read DeepSpeed checkpoint file ({type(exc).__name__}: {exc})") from exc
