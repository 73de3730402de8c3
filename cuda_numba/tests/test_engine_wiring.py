"""How the engine comes to step with FusedAdamCUDA, and that it trains as torch's Adam does.

Every Adam type of a config, ``"FusedAdam"`` included, resolves to torch's fused Adam on every
device; the kernel is chosen by its name, ``"fused_adam_cuda"``. The selection is checked on the
CPU with a cuda device named; the engine runs here (under the simulator) with the kernel chosen by
a Stack, over
ZeRO's master views: several unit buffers (fp32: the parameters are the master) or one flat
master with 16-bit twins (fp16), the loss scale and the clipping factor folded into the kernel.
"""
from __future__ import annotations

import pytest
import torch

import zkit
from zkit.core.config import load_config
from zkit.core.plugin_manager import get_plugin_manager
from zkit.core.stack import configure
from zkit_cuda_numba import plugin, runtime
from zkit_cuda_numba.fused_adam import FusedAdamCUDA

pytestmark = pytest.mark.usefixtures("sim")

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def _optimizer_record(optimizer_type: str, device: torch.device | None, stack: zkit.Stack | None = None):
    pm = get_plugin_manager(autoload=False, extra_plugins=[plugin])
    config = load_config({"train_batch_size": 1, "optimizer": {"type": optimizer_type}}, world_size=1,
                         sections=pm.config_sections())
    return configure(pm, stack or zkit.Stack(), config, device)[1]["optimizer"]


def test_fused_adam_is_torchs_fused_adam_and_the_kernel_is_chosen_by_name():
    assert runtime.unavailable_reason() is None  # the simulator makes the kernels available
    for device in (CUDA, CPU, None):  # None: no engine (zkit.zero.Init)
        for name in ("FusedAdam", "fused_adam", "Adam"):  # DeepSpeed's GPU FusedAdam types: torch's fused Adam
            record = _optimizer_record(name, device)
            assert (record.name, record.dist) == ("adam", "zkit")
        assert _optimizer_record("AdamW", device).name == "adamw"
    chosen = _optimizer_record("fused_adam_cuda", CUDA)
    assert (chosen.name, chosen.dist) == ("fused_adam_cuda", "zkit-cuda-numba")
    assert _optimizer_record("FusedAdam", CUDA, zkit.Stack(optimizer="fused_adam_cuda")).name == "fused_adam_cuda"


def test_the_kernel_by_name_without_usable_kernels_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(runtime, "unavailable_reason", lambda: "numba.cuda finds no usable CUDA driver")
    assert _optimizer_record("FusedAdam", CUDA).name == "adam"
    with pytest.raises(ValueError, match="optimizer 'fused_adam_cuda' is zkit-cuda-numba's Numba kernel, which cannot "
                                         "run here: numba.cuda finds no usable CUDA driver. Use"):
        _optimizer_record("fused_adam_cuda", CUDA)
    assert dict(plugin.zkit_report())["zkit-cuda-numba fused Adam"].startswith(
        "not registered (numba.cuda finds no usable CUDA driver)")


def test_zkit_plugins_shows_the_record_and_how_it_is_chosen():
    from zkit.cli import plugins_text

    text = plugins_text()
    assert "chosen by name (config type fused_adam_cuda) on CUDA devices" in text
    assert "(aliases: fusedadam, fused_adam)" in text  # zkit's adam answers DeepSpeed's FusedAdam
    assert "zkit-cuda-numba" in text


def test_record_factory_reads_deepspeeds_adam_settings():
    ps = [torch.nn.Parameter(torch.zeros(4))]
    opt = plugin.FUSED_ADAM.factory([{"params": ps}], lr=0.1, adam_w_mode=False, torch_adam=False)
    assert isinstance(opt, FusedAdamCUDA) and opt.in_place and not opt.adam_w_mode
    assert opt.param_groups[0]["weight_decay"] == 0.0  # DeepSpeed's default, not torch AdamW's
    with pytest.raises(ValueError, match="maximize=true is not supported"):
        plugin.FUSED_ADAM.factory([{"params": ps}], maximize=True)
    with pytest.raises(ValueError, match="unknown parameter 'lrr' for optimizer 'fused_adam_cuda'"):
        plugin.FUSED_ADAM.factory([{"params": ps}], lrr=0.1)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x.to(self.a.weight.dtype)))).float().square().mean()


def _config(stage: int, dtype: str) -> dict:
    cfg = {"train_batch_size": 4, "gradient_clipping": 0.05,
           "optimizer": {"type": "FusedAdam", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 64}}  # several units
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def _train(engine, steps: range) -> None:
    for step in steps:
        engine.backward(engine(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))))
        engine.step()


def _engine(stage: int, dtype: str, numba: bool):
    stack = zkit.Stack(optimizer="fused_adam_cuda") if numba else zkit.Stack()
    return zkit.initialize(model=_Net(), config=_config(stage, dtype), stack=stack)[0]


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("stage, dtype", [(1, "fp32"), (2, "fp16")])
def test_engine_steps_zero_masters_with_the_kernel_as_torch_adam_does(stage, dtype):
    ours, ref = _engine(stage, dtype, numba=True), _engine(stage, dtype, numba=False)
    assert isinstance(ours.optimizer, FusedAdamCUDA) and ours.records["optimizer"].name == "fused_adam_cuda"
    assert ref.records["optimizer"].name == "adam"  # "FusedAdam": torch's fused Adam
    assert len(ours.optimizer.buffers) == (len(ours.partitioner.units) if dtype == "fp32" else 1)
    assert ours.partitioner.copy_out == (dtype == "fp16")  # the step writes the fp16 parameters
    _train(ours, range(3))
    _train(ref, range(3))
    tol = 1e-6 if dtype == "fp32" else 1e-3
    for p, q in zip(_params(ours), _params(ref)):
        torch.testing.assert_close(p, q, atol=tol, rtol=tol)
    kernel = ours.partitioner.step_kernel()
    assert kernel.startswith("FusedAdamCUDA: Numba-CUDA adam_step") and "gradient x 1 " not in kernel


def test_checkpoints_move_between_the_kernel_and_torch_adam(tmp_path):
    """Saved by torch's Adam, resumed by the kernel, saved again and resumed by torch's Adam: the
    moments and step count travel (the checkpoint loader assigns each piece's state)."""
    ref = _engine(1, "fp32", numba=False)
    _train(ref, range(6))
    first = _engine(1, "fp32", numba=False)
    _train(first, range(2))
    first.save_checkpoint(str(tmp_path), tag="a")
    ours = _engine(1, "fp32", numba=True)
    ours.load_checkpoint(str(tmp_path), tag="a")
    _train(ours, range(2, 4))
    assert ours.optimizer.step_count == 4
    ours.save_checkpoint(str(tmp_path), tag="b")
    last = _engine(1, "fp32", numba=False)
    last.load_checkpoint(str(tmp_path), tag="b")
    _train(last, range(4, 6))
    for p, q in zip(_params(last), _params(ref)):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
