"""The sub-group plan and the swapped optimizer state of NVMe optimizer offload, in one process."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zkit_offload import CPUAdamW, NVMeAllocator
from zkit_offload.config import AioConfig, OffloadOptimizerConfig
from zkit_offload.swapped_state import SubGroupPlan


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 70), max_size=12), limit=st.integers(1, 100))
def test_plan_packs_parameters_in_order_without_splitting(sizes, limit):
    params = [torch.zeros(n) for n in sizes]
    plan = SubGroupPlan(params, ("exp_avg", "exp_avg_sq"), limit)
    flat = [(p, off, i) for i, m in enumerate(plan.members) for p, off in m]
    assert [id(p) for p, _, _ in flat] == [id(p) for p in params if p.numel()]
    for i, m in enumerate(plan.members):
        offsets = [off for _, off in m]
        assert offsets == [sum(p.numel() for p, _ in m[:k]) for k in range(len(m))]
        assert plan.sizes[i] == sum(p.numel() for p, _ in m)
        # a sub-group is over the limit only when it is one parameter larger than the limit
        assert plan.sizes[i] <= limit or len(m) == 1
        if i + 1 < len(plan.members):  # greedy: the next parameter did not fit
            assert plan.sizes[i] + plan.members[i + 1][0][0].numel() > limit
    assert plan.subgroups() == [{"exp_avg": n, "exp_avg_sq": n} for n in plan.sizes]


def test_plan_rejects_an_empty_sub_group_size():
    with pytest.raises(ValueError, match="sub_group_size must be at least 1 element, got 0"):
        SubGroupPlan([torch.zeros(3)], ("exp_avg",), 0)


def _allocator(tmp_path, sub_group_size=40):
    cfg = OffloadOptimizerConfig(device="nvme", nvme_path=str(tmp_path), buffer_count=2)
    alloc = NVMeAllocator(torch.device("cpu"), optimizer=cfg, aio=AioConfig(queue_depth=2))
    alloc.sub_group_size = sub_group_size
    return alloc


def _params(seed=0, sizes=(30, 20, 7, 60, 5)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]


def _grads(params, gen):
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def test_state_reads_back_from_the_swap_files_and_loads_into_them(tmp_path):
    alloc = _allocator(tmp_path)
    swapped, plain = _params(), _params()
    opt, ref = CPUAdamW(swapped, lr=1e-2), CPUAdamW(plain, lr=1e-2)
    for k in range(2):
        _grads(swapped, torch.Generator().manual_seed(k))
        _grads(plain, torch.Generator().manual_seed(k))
        alloc.step_optimizer(opt)
        ref.step()
    # in memory only the step counts; state_dict() reads the rest from the files
    assert all(set(st) == {"step"} for st in opt.state.values())
    got, want = opt.state_dict()["state"], ref.state_dict()["state"]
    for i in want:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got[i][name], want[i][name])
    assert torch.equal(opt.state.get(swapped[3])["exp_avg"], ref.state[plain[3]]["exp_avg"])
    # loaded state (as a checkpoint loader sets it) is written to the files by the next step
    opt.state[swapped[1]] = {"step": torch.tensor(7.0), "exp_avg": torch.full((20,), 0.5),
                             "exp_avg_sq": torch.full((20,), 0.25)}
    ref.state[plain[1]] = {k: v.clone() for k, v in opt.state[swapped[1]].items()}
    _grads(swapped, torch.Generator().manual_seed(9))
    _grads(plain, torch.Generator().manual_seed(9))
    alloc.step_optimizer(opt)
    ref.step()
    for p, q in zip(swapped, plain):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])
    alloc.close()


def test_step_optimizer_refuses_other_optimizers_and_changed_parameters(tmp_path):
    alloc = _allocator(tmp_path)
    params = _params()
    with pytest.raises(ValueError, match="optimizer 'AdamW' \\(AdamW\\) cannot run with .*device 'nvme'"):
        alloc.step_optimizer(torch.optim.AdamW(params))
    with pytest.raises(ValueError, match="optimizer 'sgd' \\(SGD\\) cannot run with .*fused CPU optimizers"):
        alloc.check_optimizer(torch.optim.SGD(params), "sgd")
    opt = CPUAdamW(params, lr=1e-2)
    _grads(params, torch.Generator().manual_seed(0))
    alloc.step_optimizer(opt)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4))]})
    with pytest.raises(ValueError, match="optimizer's parameters changed after its first step"):
        alloc.step_optimizer(opt)
    with pytest.raises(ValueError, match="swaps the state of one optimizer; got another one"):
        alloc.step_optimizer(CPUAdamW(_params(sizes=(3,)), lr=1e-2))
    alloc.close()
