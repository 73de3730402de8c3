"""With ``optimizer=`` given, the config's optimizer section is ignored (as in DeepSpeed): the
offload plugin's NVMe check judges the client's optimizer, not the section's, so a refusal names
the optimizer that would run."""
from __future__ import annotations

import logging

import pytest
import torch

import zkit


def test_nvme_refusal_names_the_client_optimizer_not_the_ignored_section(tmp_path, caplog):
    model = torch.nn.Linear(4, 4)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Lamb", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    with caplog.at_level(logging.WARNING, logger="zkit"), pytest.raises(ValueError) as refused:
        zkit.initialize(model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert str(refused.value).startswith(
        "optimizer 'client:sgd' (SGD) cannot run with zero_optimization.offload_optimizer.device 'nvme'")
    assert "the config names optimizer 'Lamb': the client's optimizer is trained" in caplog.text


def test_zero_init_leaves_the_optimizer_section_to_initialize(tmp_path):
    """zero.Init builds the model before anyone knows whether ``optimizer=`` will replace the
    section: it must not refuse the section's optimizer, so the refusal at initialize names the one
    that would run."""
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Lamb", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    with zkit.zero.Init(config_dict_or_path=config):
        model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError) as refused:
        zkit.initialize(model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert str(refused.value).startswith(
        "optimizer 'client:sgd' (SGD) cannot run with zero_optimization.offload_optimizer.device 'nvme'")
    # without optimizer=, initialize judges the section, as before
    with zkit.zero.Init(config_dict_or_path=config):
        model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"^optimizer 'Lamb' cannot run with zero_optimization.offload_optimizer"):
        zkit.initialize(model=model, config=config)
