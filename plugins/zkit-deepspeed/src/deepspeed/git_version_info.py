"""``deepspeed.git_version_info``: the version, build and op facts DeepSpeed records at install
(``ds_report`` and tests read them). zkit builds no op: ``installed_ops`` is all False, and
``compatible_ops`` says which ops' Python APIs zkit provides (see ``deepspeed.ops.op_builder``)."""
from __future__ import annotations

import torch

from deepspeed.ops.op_builder import ALL_OPS, compatible_ops as _compatible_ops

version = "0.19.8+zkit"
git_hash = "[none]"
git_branch = "[none]"
installed_ops: dict[str, bool] = dict.fromkeys(ALL_OPS, False)
compatible_ops: dict[str, bool] = _compatible_ops()
accelerator_name = "cuda" if torch.cuda.is_available() else "cpu"
torch_info = {
    "version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
    "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
    "cuda_version": ".".join((torch.version.cuda or "0.0").split(".")[:2]),
    "nccl_version": "0.0",
    "hip_version": "0.0",
}

__all__ = ["accelerator_name", "compatible_ops", "git_branch", "git_hash", "installed_ops", "torch_info", "version"]
