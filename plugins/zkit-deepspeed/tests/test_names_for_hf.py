"""The DeepSpeed names transformers and Accelerate use beyond a training script's, with
DeepSpeed's semantics (the drop-in's ``deepspeed.X``)."""
from __future__ import annotations

from collections import OrderedDict

import torch

from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.launcher import runner


def test_clone_tensors_for_torch_save_copies_every_tensor_off_its_storage():
    big = torch.arange(10.0, requires_grad=True)
    view = big[2:4]
    state = OrderedDict(a=view, nested={"b": [big, (big, 3)]}, tied=view, name="x")
    out = clone_tensors_for_torch_save(state)
    assert type(out) is OrderedDict and out["name"] == "x" and out["nested"]["b"][1][1] == 3
    assert torch.equal(out["a"], view.detach()) and not out["a"].requires_grad
    # each tensor is its own storage of its own size: saving it does not save the whole buffer
    assert out["a"].untyped_storage().nbytes() == 2 * 4
    assert out["a"].untyped_storage().data_ptr() != big.untyped_storage().data_ptr()
    assert out["tied"].untyped_storage().data_ptr() != out["a"].untyped_storage().data_ptr()
    assert isinstance(out["nested"]["b"][1], tuple)
    assert clone_tensors_for_torch_save(view, device="meta").device.type == "meta"


def test_launcher_environment_file_name(monkeypatch):
    import importlib

    assert runner.DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"
    monkeypatch.setenv("DS_ENV_FILE", "/tmp/env-file")
    assert importlib.reload(runner).DEEPSPEED_ENVIRONMENT_NAME == "/tmp/env-file"
    monkeypatch.delenv("DS_ENV_FILE")
    importlib.reload(runner)
