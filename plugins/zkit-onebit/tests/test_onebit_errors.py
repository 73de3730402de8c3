"""Bad parameters and unsupported combinations give errors that say what to change; the plugin
registers its records."""
from __future__ import annotations

import types
import warnings

import pytest
import torch

from zkit.core.communicator import Communicator
from zkit.core.partitioner import Partitioner
from zkit.core.stash import Stash
from zkit.core.plugin_manager import PluginError, get_plugin_manager
from zkit_onebit.adam import OneBitAdam, make_onebit_adam
from zkit_onebit.communicator import OneBitCommunicator
from zkit_onebit.zeroone_adam import ZeroOneAdam, make_zero_one_adam


class _Local(Communicator):
    """A one-process stand-in transport that records the exact calls it receives."""

    def __init__(self, world_size: int = 1) -> None:
        super().__init__(0, world_size)
        self.calls: list[str] = []
        self.backend = "gloo"

    def all_reduce(self, tensor, op="sum", async_op=False):
        self.calls.append(f"all_reduce:{op}")

    def reduce_scatter(self, output, input, op="sum", async_op=False):
        self.calls.append("reduce_scatter")

    def all_gather(self, output, input, async_op=False):
        self.calls.append("all_gather")

    def all_to_all(self, output, input, async_op=False):
        self.calls.append("all_to_all")

    def broadcast(self, tensor, src, async_op=False):
        self.calls.append("broadcast")

    def send(self, tensor, dst):
        pass

    def recv(self, tensor, src):
        pass

    def barrier(self):
        pass

    def all_gather_object(self, obj):
        return [obj]

    def subgroup(self, ranks):
        return _Local(len(ranks))


def _params():
    return [torch.nn.Parameter(torch.zeros(4))]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"freeze_step": -1}, "freeze_step must be >= 1, got -1"),
        ({"freeze_step": 0}, "freeze_step must be >= 1, got 0"),
        ({"freeze_step": 2.5}, "freeze_step must be an integer"),
        ({"lr": -1.0}, "lr must be a finite number >= 0"),
        ({"betas": (0.9, 1.0)}, r"betas must be two numbers in \[0, 1\)"),
        ({"eps": 0.0}, "eps must be a finite number > 0"),
        ({"weight_decay": -0.1}, "weight_decay must be a finite number >= 0"),
        ({"amsgrad": True}, "does not support amsgrad"),
        ({"max_grad_norm": 1.0}, "clip gradients with the config's 'gradient_clipping'"),
        ({"comm_backend_name": "mpi"}, r"comm_backend_name must be one of \('nccl', 'gloo'\)"),
        ({"bucket_numel": 4}, "bucket_numel must be >= 8"),
    ],
)
def test_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_onebit_adam([{"params": _params()}], **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_nccl_without_cuda():
    with pytest.raises(ValueError, match="comm_backend_name='nccl' needs CUDA devices and NCCL"):
        OneBitAdam(_params(), comm_backend_name="nccl")


def test_unknown_parameter_did_you_mean():
    with pytest.raises(ValueError, match="unknown OneBitAdam parameter 'freeze_steps'; did you mean 'freeze_step'"):
        make_onebit_adam([{"params": _params()}], freeze_steps=10)
    with pytest.raises(ValueError, match="Valid parameters: amsgrad, betas"):
        make_onebit_adam([{"params": _params()}], zzz=1)


def test_deepspeed_config_params_accepted():
    opt = make_onebit_adam(
        [{"params": _params()}],
        lr=1e-3, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, freeze_step=400,
        cuda_aware=False, comm_backend_name="gloo",
    )
    assert opt.freeze_step == 400 and opt.param_groups[0]["betas"] == (0.9, 0.999)


class _Partitioner:
    def __init__(self, stage, comm, local_norm=3.0):
        self.stage, self.comm = stage, comm
        self.local_norm = local_norm
        self.optimizer = None

    # the kernel's rule: reduce unless the optimizer says it needs no reduction now
    gradient_reduction = Partitioner.gradient_reduction

    def grad_norm(self):
        return torch.tensor(self.local_norm)


def _attached(opt, part):
    part.optimizer = opt
    opt.attach(part)
    return part


class _Summing(_Local):
    """Two ranks holding the same values: a sum all-reduce doubles them."""

    def all_reduce(self, tensor, op="sum", async_op=False, key=None):
        super().all_reduce(tensor, op)
        tensor.mul_(2)


def test_stage0_grad_norm_is_agreed_on_while_reduction_is_off():
    """The engine's norm goes through the zkit_grad_norm hook: the partitioner's answer, wrapped
    by every installed plugin's wrapper (zkit-onebit's and zkit-pipeline's here)."""
    p = _params()
    opt = OneBitAdam(p, freeze_step=1)
    part = _attached(opt, _Partitioner(0, _Summing(2)))
    step = types.SimpleNamespace(partitioner=part, comm=part.comm, stash=Stash())
    norm = get_plugin_manager().hook.zkit_grad_norm
    assert norm(step=step).item() == 3.0 and part.comm.calls == []  # reduced gradients: local norm is global
    p[0].grad = torch.ones(4)
    opt.step()
    assert not part.gradient_reduction
    assert norm(step=step).item() == pytest.approx(3.0)  # sqrt((9 + 9) / 2)
    assert part.comm.calls == ["all_reduce:sum"]
    part.local_norm = float("inf")
    assert not torch.isfinite(norm(step=step))  # an overflow anywhere is an overflow everywhere


def test_zero3_refused():
    opt = OneBitAdam(_params(), freeze_step=1)
    with pytest.raises(ValueError, match="supports ZeRO stages 0, 1 and 2, not stage 3"):
        opt.attach(_Partitioner(3, _Local(2)))


def test_onebit_adam_keeps_the_onebit_communicator_exact_until_its_freeze_step():
    """The optimizer record asks the stack for the 'onebit' communicator; the optimizer decides
    when it compresses (never at ZeRO 0, where momenta travel compressed instead)."""
    p = _params()
    opt = OneBitAdam(p, freeze_step=1)
    part = _attached(opt, _Partitioner(0, OneBitCommunicator(_Local(2))))
    assert part.comm.compress is False
    opt = OneBitAdam(_params(), freeze_step=1)
    part = _attached(opt, _Partitioner(2, OneBitCommunicator(_Local(2))))
    assert part.comm.compress is False and opt.needs_gradient_reduction
    opt.param_groups[0]["params"][0].grad = torch.ones(4)
    opt.step()
    assert opt.frozen and part.comm.compress is True and part.gradient_reduction


def test_stage2_refuses_a_communicator_that_is_not_onebit():
    opt = OneBitAdam(_params(), freeze_step=5)
    with pytest.raises(ValueError, match="OneBitAdam at ZeRO stage 2 reduces its gradients 1-bit compressed through the "
                                         "'onebit' communicator, but this engine's communicator is a _Local"):
        _attached(opt, _Partitioner(2, _Local(2)))


def test_the_optimizer_record_chooses_its_communicator_unless_the_stack_does():
    from zkit.core.config import load_config
    from zkit.core.stack import Stack, configure

    pm = get_plugin_manager()
    config = load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "OneBitAdam"},
                          "zero_optimization": {"stage": 2}}, world_size=1, sections=pm.config_sections())
    assert configure(pm, Stack(), config)[1]["communicator"].name == "onebit"
    plain = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}, world_size=1,
                        sections=pm.config_sections())
    assert configure(pm, Stack(optimizer="onebitadam"), plain)[1]["communicator"].name == "onebit"
    assert configure(pm, Stack(communicator="torch"), config)[1]["communicator"].name == "torch"


def test_stage0_switches_gradient_reduction_off_at_freeze():
    p = _params()
    opt = OneBitAdam(p, freeze_step=2)
    part = _attached(opt, _Partitioner(0, _Local(1)))
    seen = []
    for _ in range(3):
        p[0].grad = torch.ones(4)
        opt.step()
        seen.append(part.gradient_reduction)
    assert seen == [True, False, False]
    assert opt.frozen and not part.gradient_reduction and not opt.needs_gradient_reduction


def test_communicator_keeps_small_integer_and_max_reductions_exact():
    transport = _Local(2)
    comm = OneBitCommunicator(transport, min_numel=16)
    comm.all_reduce(torch.zeros(8))  # below min_numel
    comm.all_reduce(torch.zeros(64, dtype=torch.int64))  # integers
    comm.all_reduce(torch.zeros(64), op="max")
    assert transport.calls == ["all_reduce:sum", "all_reduce:sum", "all_reduce:max"]
    assert comm.stats()["all_reduce"]["calls"] == 3
    with pytest.raises(ValueError, match="unknown reduce op 'prod'"):
        comm.all_reduce(torch.zeros(64), op="prod")


def test_communicator_bad_construction():
    with pytest.raises(TypeError, match="needs a zkit Communicator as transport"):
        OneBitCommunicator(object())
    with pytest.raises(TypeError, match="cannot wrap another OneBitCommunicator"):
        OneBitCommunicator(OneBitCommunicator(_Local(2)))
    with pytest.raises(ValueError, match="min_numel must be >= 1"):
        OneBitCommunicator(_Local(2), min_numel=0)


def test_communicator_refuses_unbounded_error_buffers():
    comm = OneBitCommunicator(_Local(2), min_numel=1, max_buffers=2)
    from zkit_onebit.compression import ChunkLayout

    layout = ChunkLayout.for_all_reduce(16, 2)
    comm.feedback_for("a", layout, torch.device("cpu"))
    comm.feedback_for("b", layout, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="reduces a new tensor every step"):
        comm.feedback_for("c", layout, torch.device("cpu"))


def test_communicator_state_dict_roundtrip_and_world_size_change():
    from zkit_onebit.compression import ChunkLayout

    comm = OneBitCommunicator(_Local(2), min_numel=1)
    layout = ChunkLayout.for_all_reduce(40, 2)
    fb = comm.feedback_for("bucket", layout, torch.device("cpu"))
    fb.worker.normal_()
    fb.server.normal_()
    state = comm.state_dict()
    other = OneBitCommunicator(_Local(2), min_numel=1)
    other.load_state_dict(state)
    restored = other.feedback_for("bucket", layout, torch.device("cpu"))
    assert torch.equal(restored.worker, fb.worker) and torch.equal(restored.server, fb.server)
    four = OneBitCommunicator(_Local(4), min_numel=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        four.load_state_dict(state)
    assert "saved on 2 ranks and is restored on 4" in str(caught[0].message)
    wrong = ChunkLayout.for_all_reduce(48, 2)
    with pytest.raises(ValueError, match=r"error-feedback state is for \(kind, numel, world_size\)"):
        fb.load_state_dict(OneBitCommunicator(_Local(2)).feedback_for("x", wrong, torch.device("cpu")).state_dict())


def test_error_feedback_saved_for_another_layout_starts_at_zero_with_one_warning():
    """A checkpoint of another ZeRO stage (its gradients all-reduced, here reduce-scattered) or
    bucket size: the run goes on from zero error buffers, as on another world size."""
    from zkit_onebit.compression import ChunkLayout

    comm = OneBitCommunicator(_Local(2), min_numel=1)
    for key in ("grad/0", "grad/1"):
        comm.feedback_for(key, ChunkLayout.for_all_reduce(64, 2), torch.device("cpu")).worker.fill_(1.0)
    loaded = OneBitCommunicator(_Local(2), min_numel=1)
    loaded.load_state_dict(comm.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fbs = [loaded.feedback_for(key, ChunkLayout.for_reduce_scatter(64, 2), torch.device("cpu"))
               for key in ("grad/0", "grad/1")]
    assert all(not fb.worker.any() for fb in fbs)
    assert len(caught) == 1 and "1-bit error feedback 'grad/0' was saved for (kind, numel, world_size) = " \
        "('flat', 64, 2) and this run reduces ('sharded', 64, 2)" in str(caught[0].message)


def test_plugin_registers_records():
    pm = get_plugin_manager()
    assert pm.lookup("communicator", "onebit").dist.startswith("zkit-onebit")
    rec = pm.lookup("optimizer", "OneBitAdam")
    assert rec.state_names == ("exp_avg", "exp_avg_sq")
    assert pm.lookup("optimizer", "onebit_adam") is rec
    with pytest.raises(PluginError, match="Did you mean 'onebitadam'"):
        pm.lookup("optimizer", "onebitadm")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"var_freeze_step": 0}, "ZeroOneAdam: var_freeze_step must be an integer >= 1, got 0"),
        ({"var_update_scaler": 0}, "ZeroOneAdam: var_update_scaler must be an integer >= 1, got 0"),
        ({"local_step_scaler": 1.5}, "ZeroOneAdam: local_step_scaler must be an integer >= 1, got 1.5"),
        ({"local_step_clipper": True}, "ZeroOneAdam: local_step_clipper must be an integer >= 1, got True"),
        ({"lr": float("nan")}, "ZeroOneAdam: lr must be a finite number >= 0"),
        ({"amsgrad": True}, "ZeroOneAdam does not support amsgrad"),
        ({"freeze_step": 10}, "unknown ZeroOneAdam parameter 'freeze_step'; did you mean 'var_freeze_step'"),
    ],
)
def test_zero_one_adam_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_zero_one_adam([{"params": _params()}], **kwargs)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_one_adam_refuses_sharded_states(stage):
    opt = ZeroOneAdam(_params(), var_freeze_step=4)
    with pytest.raises(ValueError, match=f"ZeroOneAdam supports ZeRO stage 0 only, not stage {stage}"):
        opt.attach(_Partitioner(stage, _Local(2)))


def test_zero_one_adam_deepspeed_config_and_record():
    opt = make_zero_one_adam(
        [{"params": _params()}], lr=1e-3, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, var_freeze_step=1000,
        var_update_scaler=16, local_step_scaler=32678, local_step_clipper=16, cuda_aware=False,
        comm_backend_name="gloo",
    )
    assert opt.freeze_step == 1000 and opt.needs_gradient_reduction
    rec = get_plugin_manager().lookup("optimizer", "ZeroOneAdam")
    assert rec.factory is make_zero_one_adam and "sync_params" in rec.state_names


def test_zero_one_adam_single_process_schedule():
    """One process: variance steps at 1, 2, 4, 6, 8, ... with var_update_scaler 2; the variance
    changes only on them; after var_freeze_step it is frozen."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = ZeroOneAdam([p], lr=0.1, var_freeze_step=7, var_update_scaler=2)
    flags, variances = [], []
    for t in range(1, 11):
        flags.append(opt.needs_gradient_reduction)
        p.grad = torch.full((3,), float(t))
        opt.step()
        variances.append(opt.state[p]["exp_avg_sq"].clone())
    assert [t for t, f in zip(range(1, 11), flags) if f] == [1, 2, 4, 6]
    changed = [t for t in range(2, 11) if not torch.equal(variances[t - 1], variances[t - 2])]
    assert changed == [2, 4, 6]
    assert opt.frozen and opt.var_updates == 4
