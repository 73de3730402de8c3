"""ZeRO stage 3: equivalence with PyTorch, user access to partitioned parameters, Init, diagnostics."""
import pytest

from zkit.testing import run_ranks

import engine_ranks as er


def _max_diff(a, b):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("world", (2, 4))
def test_stage3_matches_torch_with_tied_and_reused_parameters(world):
    cases = [("fp32", 1), ("fp32", 2)] + ([("bf16", 1), ("fp16", 2)] if world == 2 else [])
    results = run_ranks(er.stage3_matrix, world, args=(cases,), timeout=600)
    for gas in (1, 2):
        ref = er.reference(3, gas, world)
        for r in results:
            assert _max_diff(r[("fp32", gas)][0], ref) < 1e-5
    if world == 2:
        assert _max_diff(results[0][("bf16", 1)][0], er.reference(3, 1, 2)) < 5e-2
        assert _max_diff(results[0][("fp16", 2)][0], er.reference(3, 2, 2)) < 1e-2
    # parameters are gathered (all-gather) and gradients reduce-scattered
    stats = results[0][("fp32", 1)][2]
    assert stats["all_gather"]["calls"] > 0 and stats["reduce_scatter"]["calls"] > 0


def test_persistent_small_parameters_give_the_same_result():
    results = run_ranks(er.stage3_matrix, 2, args=([("fp32", 1)],), kwargs={"persistence": 10**6}, timeout=300)
    assert _max_diff(results[0][("fp32", 1)][0], er.reference(3, 1, 2)) < 1e-5


def test_released_parameter_use_is_a_clear_error_and_gathered_edits_stick():
    results = run_ranks(er.stage3_user_code, 2, timeout=300)
    for r in results:
        assert r["shape"] == (6, 6)
        assert "parameter 'mix.weight' (shape (6, 6)) is partitioned by ZeRO stage 3" in r["error"]
        assert "GatheredParameters" in r["error"]
        assert r["after_edit"] == pytest.approx(0.5 * 36)
        assert r["after_step_mean"] == pytest.approx(0.5, abs=0.05)
    assert results[0]["after_step_mean"] == results[1]["after_step_mean"]


def _use_from_another_thread() -> dict:
    import threading

    import torch

    import zkit

    cfg = er.config(3, "fp32", 1, 1)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = zkit.initialize(model=er.make_model(), config=cfg)
    er.train_engine(engine, 1, 1, 1)
    weight = engine.module.mix.weight
    out = {"released": weight._zkit_released}

    def use() -> None:
        try:
            out["sum"] = float(weight.sum())
        except RuntimeError as exc:
            out["error"] = str(exc)

    with engine.partitioner.backward_context(boundary=False):
        worker = threading.Thread(target=use)
        worker.start()
        worker.join()
    with zkit.zero.GatheredParameters([weight]):
        out["expected"] = float(weight.sum())
    engine.close()
    return out


def test_a_parameter_used_on_another_thread_is_gathered():
    """autograd runs a CUDA backward on a device thread of its own, not on the thread that entered
    the backward context: the gather callback must be seen there (a per-thread one raised "not
    gathered here" in backward on every GPU)."""
    (r,) = run_ranks(_use_from_another_thread, 1, timeout=120)
    assert r["released"] and "error" not in r, r
    assert r["sum"] == pytest.approx(r["expected"])


def test_model_built_under_init_is_partitioned_and_trains():
    results = run_ranks(er.stage3_built_with_init, 2, timeout=300)
    params, sizes = results[0]
    assert _max_diff(params, er.reference(3, 1, 2)) < 1e-5
    assert max(sizes) <= 4  # every parameter is a one-element placeholder after Init


def test_parent_reinitialising_children_under_init_builds_the_same_model():
    # each rank seeds differently; rank 0's values are broadcast, as for the parameters themselves
    assert run_ranks(er.gpt_built_with_init, 2, timeout=120) == [0.0, 0.0]


def test_ranks_running_different_modules_are_named():
    import re

    for message in run_ranks(er.stage3_divergent_modules, 2, timeout=120):
        assert re.search(
            r"ZeRO stage 3 needs every rank to run the same modules in the same order; at module #1 "
            r"rank \d ran '(b|c)' but rank \d ran '(b|c)'",
            message,
        ), message


def _gathered_window(prefetch: int, reuse: int = 0) -> dict:
    """Rank function: a chain of 8 equal layers at stage 3 with nothing persistent; the most
    parameter elements gathered at once during forward and backward, one unit's size, the
    all-gathers each backward issued and the losses."""
    import torch

    import zkit

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(10, 10) for _ in range(8)])
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": prefetch, "stage3_max_reuse_distance": reuse}}
    engine, *_ = zkit.initialize(model=model, config=cfg)
    sharded = engine.partitioner.sharded
    most = [0]
    gathers, losses = [], []

    def record(*_):
        gathered = sum(su.unit.padded for su in sharded if su.full is not None)
        # the partitioner's running count (read at every gather and keep decision) is the walk's
        assert engine.partitioner._live() == gathered, (engine.partitioner._live(), gathered)
        most[0] = max(most[0], gathered)

    for layer in model:
        layer.register_forward_hook(record)
        layer.register_full_backward_hook(record)
    for step in range(3):
        loss = engine(torch.ones(2, 10) * (step + 1)).square().mean()
        before = engine.comm_stats()["all_gather"]["calls"]
        engine.backward(loss)
        gathers.append(engine.comm_stats()["all_gather"]["calls"] - before)
        engine.step()
        losses.append(loss.item())
    return {"most": most[0], "unit": max(su.unit.padded for su in sharded), "gathers": gathers, "losses": losses}


def test_stage3_gathers_at_most_the_prefetch_window_ahead():
    """What stage 3 holds gathered is bounded by the prefetch window (which counts the units
    gathered ahead already), whatever the model's size."""
    (r, _) = run_ranks(_gathered_window, 2, args=(250,), timeout=300)
    # the unit in use, the one finishing, and the window ahead (250 elements: two 110-element units)
    assert r["most"] <= 250 + 2 * r["unit"], r


def test_stage3_keeps_units_gathered_for_a_reuse_within_the_distance():
    """``stage3_max_reuse_distance``: at the default (1e9 elements) nothing forward gathered is
    gathered again in backward; at 0 backward gathers all 8 layers but the last (used next); in
    between, the units whose backward use comes within the distance. The losses are the same."""
    runs = {reuse: run_ranks(_gathered_window, 2, args=(0, reuse), timeout=300)[0] for reuse in (0, 330, 10**9)}
    unit = runs[0]["unit"]
    assert runs[10**9]["gathers"][1:] == [0, 0], runs[10**9]
    assert runs[10**9]["most"] == 8 * unit
    assert runs[0]["gathers"][1:] == [8, 8], runs[0]
    # layer k (of 0-7) is used again after the 14 - 2k layers between its forward and its backward:
    # 330 elements (three 110-element units) keep layers 6 and 7
    assert runs[330]["gathers"][1:] == [6, 6], runs[330]
    assert runs[0]["losses"] == runs[330]["losses"] == runs[10**9]["losses"]


def test_spare_buffers_keep_the_latest_host_buffers_up_to_their_limit_and_only_unshared_ones():
    import torch

    from zkit.zero.sharded_params import SpareBuffers

    spares = SpareBuffers(limit_bytes=2 * 40)
    a = spares.take(10, torch.float32, torch.device("cpu"))
    spares.give(a)
    assert spares.kept == 40
    assert spares.take(10, torch.float32, torch.device("cpu")) is a  # the same size and dtype again
    assert spares.take(10, torch.float32, torch.device("cpu")) is not a and spares.kept == 0
    assert spares.take(10, torch.bfloat16, torch.device("cpu")).dtype == torch.bfloat16
    viewed = torch.empty(10)
    view = viewed[2:5]  # noqa: F841 - autograd may hold such a view: the buffer must not be reused
    spares.give(viewed)
    assert spares.kept == 0
    for _ in range(3):
        spares.give(torch.empty(10))
    assert spares.kept == 80  # the third pushed out the first
    older = torch.empty(10)
    spares.give(older)
    newest = torch.empty(20)  # as large as the limit: it takes the place of both kept ones
    spares.give(newest)
    assert spares.kept == 80
    assert spares.take(10, torch.float32, torch.device("cpu")) is not older  # pushed out
    assert spares.take(20, torch.float32, torch.device("cpu")) is newest
    spares.give(torch.empty(30))  # larger than the limit: never kept
    assert spares.kept == 0
    spares.clear()
    assert spares.kept == 0 and spares.take(10, torch.float32, torch.device("cpu")) is not a
    meta = torch.empty(10, device="meta")
    spares.give(meta)  # not host memory: left to its own allocator
    assert spares.kept == 0


def _gathered_buffer_still_viewed(release_all: bool) -> dict:
    """Rank function: three equal layers computing ``x @ weight.t()`` (autograd saves the view of
    the gathered buffer, not the parameter) at stage 3, every unit released after use, against
    plain PyTorch on the same batches."""
    import copy

    import torch

    import zkit

    class ViewLinear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8, 8) / 3)

        def forward(self, x):
            return torch.tanh(x @ self.weight.t())

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[ViewLinear() for _ in range(3)])
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_reuse_distance": 0 if release_all else 10**9}}
    engine, *_ = zkit.initialize(model=model, config=cfg)
    world, rank = engine.world_size, engine.rank
    for step in range(3):
        x = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x[rank * 4 : (rank + 1) * 4]).square().mean())
        engine.step()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with zkit.zero.GatheredParameters(list(model.parameters())):
        diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return {"diff": diff}


def test_a_gathered_buffer_autograd_still_views_is_not_reused_for_another_unit():
    """Released units give their host buffers to the next gather of the same size, except a
    buffer that a view saved for backward still reads: that one would be overwritten."""
    for out in run_ranks(_gathered_buffer_still_viewed, 2, args=(True,), timeout=300):
        assert out["diff"] < 1e-5, out


def _gradients_kept_by_a_hook() -> dict:
    """Rank function: three equal bias-free layers at stage 3; a post-accumulate-grad hook,
    registered before ``zkit.initialize``, keeps each weight's ``.grad`` of the first backward.
    Those tensors against plain PyTorch's gradients of the same batch."""
    import copy

    import torch

    import zkit

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(3)])
    ref = copy.deepcopy(model)
    kept = {}

    def keep(i: int):
        def hook(p) -> None:  # a hook that returns a value hands it on to the next hook
            kept.setdefault(i, p.grad)
        return hook

    for i, layer in enumerate(model):
        layer.weight.register_post_accumulate_grad_hook(keep(i))
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_reuse_distance": 0}}
    engine, *_ = zkit.initialize(model=model, config=cfg)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    engine.backward(engine(x).square().mean())
    ref(x).square().mean().backward()
    return {"diff": max((kept[i] - layer.weight.grad).abs().max().item() for i, layer in enumerate(ref))}


def test_a_gradient_user_code_keeps_is_not_reused_for_another_weight():
    """Stage 3 computes weight gradients into the buffers of earlier ones, but never into one that
    user code (a post-accumulate-grad hook) may still hold."""
    (out,) = run_ranks(_gradients_kept_by_a_hook, 1, timeout=300)
    assert out["diff"] < 1e-6, out


def _hook_that_returns_a_value(stage: int) -> str:
    """Rank function: a post-accumulate-grad hook registered before ``zkit.initialize`` returns
    the gradient; the error backward raises."""
    import torch

    import zkit

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model[0].weight.register_post_accumulate_grad_hook(lambda p: p.grad)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": stage}}
    engine, *_ = zkit.initialize(model=model, config=cfg)
    try:
        engine.backward(engine(torch.ones(2, 4)).sum())
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("stage,world", [(1, 2), (3, 1), (1, 1)])
def test_a_user_hook_returning_a_value_is_named_as_the_cause(stage, world):
    messages = run_ranks(_hook_that_returns_a_value, world, args=(stage,), timeout=300)
    # one replica, stages 0-2 and stage 3 with every unit persistent (this model's): zkit hooks no
    # parameter, torch says it
    if world == 1:
        assert messages == ["Tensor post accumulate grad hooks should return None."]
        return
    assert messages == [(
        f"ZeRO stage {stage}: its gradient hook was called with a Tensor of shape (4, 4) that is not one of the "
        "model's parameters. A post-accumulate-grad hook registered before zkit.initialize returned a value, and "
        "torch passes that value on to the next hook in place of the parameter; make that hook return None"
    )] * world


def _gathers_per_unit_kind(unit: str | None, offload_param: bool = False) -> dict:
    """Rank function: a 3-layer GPT at stage 3, nothing persistent, nothing kept for reuse; the
    units, the all-gathers of one forward and one backward, whether at one replica a gathered
    parameter lies in its unit's shard, and the parameters after two steps. ``unit`` None: the
    config's default; ``offload_param``: the shards on the host (zkit-offload, ``cpu``)."""
    import torch

    import zkit
    from zkit.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=3, n_head=2, d_model=16))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}}
    if unit is not None:
        cfg["zero_optimization"]["stage3_gather_unit"] = unit
    if offload_param:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    engine, *_ = zkit.initialize(model=model, config=cfg)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    out = {"units": sorted(engine.partitioner.unit_modules), "in_shard": []}

    def gathers() -> int:
        return engine.comm_stats().get("all_gather", {}).get("calls", 0)

    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Copies.count += func.overloadpacket.__name__ in ("copy_", "_to_copy")
            return func(*args, **(kwargs or {}))

    for _ in range(2):
        calls = gathers()
        Copies.count = 0
        with Copies():
            loss = engine(ids, ids)
        out["forward_copies"] = Copies.count
        out["forward"], calls = gathers() - calls, gathers()
        engine.backward(loss)
        out["backward"] = gathers() - calls
        engine.step()
    weight = model.blocks[1].mlp.fc.weight
    with zkit.zero.GatheredParameters([weight]):
        su = weight._zkit_unit
        shard = su.shard
        out["in_shard"] = (shard is not None and shard.data_ptr() <= weight.data_ptr() < shard.data_ptr()
                           + shard.numel() * shard.element_size())
    out["params"] = er.params_of(engine)
    engine.close()
    return out


def test_stage3_gathers_a_block_per_collective_and_the_root():
    """Per block (the default): one all-gather per block and one for the root in forward and again
    in backward; DeepSpeed's per-module units gather every module with parameters apiece."""
    block = run_ranks(_gathers_per_unit_kind, 2, args=("block",), timeout=300)[0]
    assert block["units"] == ["", "blocks.0", "blocks.1", "blocks.2"]
    assert block["forward"] == block["backward"] == 4
    module = run_ranks(_gathers_per_unit_kind, 2, args=("module",), timeout=300)[0]
    assert len(module["units"]) > 4 and module["forward"] >= len(module["units"])


def test_one_replica_computes_with_the_shard_itself():
    (r,) = run_ranks(_gathers_per_unit_kind, 1, args=("block",), timeout=120)
    assert r["in_shard"] is True
    assert r["forward_copies"] == 0  # each of the 4 units gathered with no copy


@pytest.mark.parametrize("world", (1, 2, 4))
def test_parameters_on_the_host_are_gathered_per_block_by_default_with_the_same_result(world):
    """offload_param on cpu: a block is one copy to the device and one collective, as without
    offload (per module, 2 ranks took 65 collectives a step of bench_host.py's 2-layer GPT where
    per block takes 13); the parameters after training are exactly those of stage 3 without
    offload and of the per-module units, which stay selectable."""
    pytest.importorskip("zkit_offload")
    host = run_ranks(_gathers_per_unit_kind, world, args=(None, True), timeout=300)
    device = run_ranks(_gathers_per_unit_kind, world, args=(None,), timeout=300)
    module = run_ranks(_gathers_per_unit_kind, world, args=("module", True), timeout=300)
    assert host[0]["units"] == ["", "blocks.0", "blocks.1", "blocks.2"]
    assert len(module[0]["units"]) > 4
    if world > 1:
        assert host[0]["forward"] == host[0]["backward"] == 4
        assert module[0]["forward"] >= len(module[0]["units"])
    for a, b, c in zip(host, device, module):
        assert _max_diff(a["params"], b["params"]) == 0 and _max_diff(a["params"], c["params"]) == 0


def _torch_function_calls(persistence: int) -> dict:
    """Rank function: calls into ``ZeroParameter.__torch_function__`` during a steady-state step
    of a small GPT at stage 3 with ``stage3_param_persistence_threshold`` ``persistence``; the
    classes of a persistent unit's parameters gathered and once released, and the error of a use
    while released."""
    import torch

    import zkit
    from zkit.models.gpt import GPT, GPTConfig
    from zkit.zero.sharded_params import ResidentZeroParameter, ZeroParameter

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": persistence}}
    engine, *_ = zkit.initialize(model=model, config=cfg)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(ids, ids))
    engine.step()
    calls = []
    original = ZeroParameter.__dict__["__torch_function__"].__func__

    def counted(cls, func, types, args=(), kwargs=None):
        calls.append(func)
        return original(cls, func, types, args, kwargs)

    ZeroParameter.__torch_function__ = classmethod(counted)
    try:
        engine.backward(engine(ids, ids))
        engine.step()
    finally:
        ZeroParameter.__torch_function__ = classmethod(original)
    weight = model.blocks[0].mlp.fc.weight
    out = {"calls": len(calls), "gathered": type(weight).__name__,
           "grad_hooks": len(weight._post_accumulate_grad_hooks or ())}
    su = weight._zkit_unit
    if su.persistent:
        su.release(force=True)
        out["released"] = type(weight).__name__
        try:
            weight.sum()
        except RuntimeError as e:
            out["error"] = str(e)
        su.wait()
        out["again"] = type(weight).__name__
    out["kinds"] = isinstance(weight, ZeroParameter), isinstance(weight, ResidentZeroParameter)
    engine.close()
    return out


def test_persistent_units_use_torch_s_own_dispatch_and_released_units_are_intercepted():
    """A persistent unit is never released between uses: its parameters dispatch as an
    nn.Parameter's (no call into Python per op and per ``.grad`` access), and at one replica with
    gradients written in place no hook runs per gradient; once released (here by
    hand) they are gathered on use or refused again. Units released between uses still are."""
    (kept,) = run_ranks(_torch_function_calls, 1, args=(10**6,), timeout=120)
    assert kept["calls"] == 0
    assert kept["grad_hooks"] == 0  # one replica, nothing to release: no Python call per gradient either
    assert (kept["gathered"], kept["released"], kept["again"]) == (
        "ResidentZeroParameter", "ZeroParameter", "ResidentZeroParameter")
    assert "parameter 'blocks.0.mlp.fc.weight' (shape (64, 16)) is partitioned by ZeRO stage 3" in kept["error"]
    assert kept["kinds"] == (True, True)
    (released,) = run_ranks(_torch_function_calls, 1, args=(0,), timeout=120)
    assert released["calls"] > 0 and released["gathered"] == "ZeroParameter" and released["kinds"] == (True, False)
    assert released["grad_hooks"] == 1  # each unit is released as soon as its gradients are in
