"""offload_optimizer never changes what the optimizer computes: every Adam section, under every
type name and alias, gives the same parameters with and without offload (fp32, 1e-6 relative)."""
from __future__ import annotations

import pytest
import torch

import offload_ranks as orr
from zkit.testing import run_ranks


@pytest.fixture(scope="module")
def runs() -> dict:
    (out,) = run_ranks(orr.same_optimizer_with_and_without_offload, 1, args=(2,), timeout=300)
    return out


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted(orr.SAME_OPTIMIZER_CASES))
def test_offloaded_optimizer_computes_the_same(runs, name):
    _close(runs[(name, "cpu")], runs[(name, "none")])


def test_cpu_adam_type_names_follow_deepspeeds_default(runs):
    # DeepSpeedCPUAdam's adamw_mode defaults to true: the same as "Adam" (AdamW) with that decay
    _close(runs[("DeepSpeedCPUAdam", "cpu")], runs[("Adam", "none")])
    _close(runs[("DeepSpeedCPUAdam", "none")], runs[("Adam", "none")])
    _close(runs[("cpu_adam-adamw_mode-false", "cpu")], runs[("Adam-l2", "none")])


def test_a_weight_decay_default_differs_from_torchs():
    # the reference the cases rely on: AdamW's default decay here is DeepSpeed's 0, not torch's 0.01
    from zkit.optim.plugin import adam_settings

    assert adam_settings("adamw", {})[1]["weight_decay"] == 0.0
    assert adam_settings("adam", {})[0] is True


@pytest.mark.parametrize("stage", [1, 2])
def test_an_optimizer_without_a_cpu_kernel_same_by_config_and_by_stack(tmp_path, stage):
    (out,) = run_ranks(orr.other_optimizer_on_offload, 1, args=(stage, str(tmp_path)), timeout=300)
    for route in ("config", "stack"):
        assert out[route]["allocator"] == "host"
        _close(out[route]["params"], out["none"]["params"])
        # refused at initialize on nvme, naming the optimizer and the device, by either route
        assert "cannot run with zero_optimization.offload_optimizer.device 'nvme'" in out[f"nvme-{route}"]
        assert "'sgd'" in out[f"nvme-{route}"].lower()
