"""What shows that a feature of the composition matrix (and of the fuzzer) really ran.

A cell that equals its reference proves nothing when its feature was dropped on the way (a config
key ignored, a stack choice lost, a path below its threshold): each check here looks at the trained
engine for a trace only the feature leaves (compressed bytes, state in swap files, partitions that
really split, recomputed blocks, ...) and returns what is missing, or ``None``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from zkit.testing import CountingBackend

STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}


class RecomputeCounter:
    """Counts module forwards run inside a backward pass: activation checkpointing's recomputes."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.recomputes = 0
        for module in model.modules():
            module.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        # while Dynamo traces a forward the hook does nothing: the call it would make is a graph
        # break at every module, and a compiled forward's recomputation is the compiled backward's
        if torch.compiler.is_compiling():
            return
        if torch._C._current_graph_task_id() != -1:  # a backward pass is running
            self.recomputes += 1


class RegionCountingBackend(CountingBackend):
    """zkit.testing.CountingBackend that also counts the checkpointed regions Dynamo traced into
    the graphs it was handed (torch's checkpoint operator): a region that ran eagerly, at a graph
    break, is not among them; and the calls of its compiled graphs made while a backward pass runs
    (``recomputed``): a compiled forward run as an eager checkpoint's recomputation. A graph's own
    compiled backward is not such a call."""

    regions = 0
    recomputed = 0

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        tag = torch.ops.higher_order.tag_activation_checkpoint
        self.regions += sum(n.op == "call_function" and n.target is tag for n in gm.graph.nodes)
        compiled = super().__call__(gm, example_inputs)

        @functools.wraps(compiled)  # keeps the calling convention the backend marked on it
        def counted(*args: Any) -> Any:
            if torch._C._current_graph_task_id() != -1:
                self.recomputed += 1
            return compiled(*args)

        return counted


def _partitioner(engine: Any) -> Any:
    return getattr(engine, "partitioner", None)


def _stage(engine: Any, stage: int) -> str | None:
    p = _partitioner(engine)
    if p is None or p.stage != stage:
        return f"the partitioner is {type(p).__name__} at stage {getattr(p, 'stage', None)}, not stage {stage}"
    if p.world > 1 and sum(u.shard for u in p.units) >= sum(u.numel for u in p.units):
        return f"stage {stage} over {p.world} replicas keeps every element on this rank"
    return None


def _host_allocator(engine: Any, purpose: str) -> str | None:
    from zkit_offload.allocators import HostAllocator

    if not isinstance(engine.allocator, HostAllocator):
        return f"the allocator is {type(engine.allocator).__name__}, not zkit-offload's"
    if purpose not in engine.allocator.host_purposes:
        return f"the allocator keeps {engine.allocator.host_purposes} on the host, not {purpose!r}"
    return None


def _nvme(engine: Any) -> str | None:
    on_disk = engine.allocator.stats().get("optim_state_nvme", {}).get("live", 0)
    return None if on_disk > 0 else "no optimizer state in NVMe swap files"


def _compressed(engine: Any) -> str | None:
    stats = engine.comm_stats()
    sent = sum(v["bytes"] for k, v in stats.items() if k.endswith("_1bit"))
    return None if sent > 0 else f"nothing was sent 1-bit compressed: {stats}"


def _onebit_comm(engine: Any) -> str | None:
    from zkit_onebit import OneBitCommunicator

    return None if isinstance(engine.comm, OneBitCommunicator) else f"the engine reduces through {engine.comm!r}"


def _counting_comm(engine: Any, model: torch.nn.Module, run: dict) -> str | None:
    from composition_comm import reduced_through

    grid = getattr(model, "num_stages", 1) > 1 or _tensor_parallel(model) is None
    return reduced_through(engine, run["comm_built"](), run["replicas"], grid)


def _dtype(engine: Any, dtype: torch.dtype) -> str | None:
    got = {p.dtype for p in engine.module.parameters()}
    return None if got == {dtype} else f"parameters in {got}, not {dtype}"


def _optimizer(engine: Any, name: str) -> str | None:
    from zkit_onebit.plugin import onebit_optimizer

    opt = onebit_optimizer(engine)
    return None if type(opt).__name__ == name else f"the optimizer is {type(engine.optimizer).__name__}, not {name}"


def _named_optimizer(engine: Any, name: str) -> str | None:
    opt = engine.optimizer
    for _ in range(4):
        if type(opt).__name__ == name:
            return None
        opt = getattr(opt, "optimizer", None)
    return f"the engine steps {type(engine.optimizer).__name__}, not {name}"


def _client_sgd(engine: Any) -> str | None:
    opt = engine.optimizer
    while opt is not None and not isinstance(opt, torch.optim.SGD):
        opt = getattr(opt, "optimizer", None)
    if opt is None:
        return f"the engine steps {type(engine.optimizer).__name__}, not the client's SGD"
    return None if any("momentum_buffer" in s for s in opt.state.values()) else "the client's SGD never stepped"


def _tensor_parallel(model: torch.nn.Module) -> str | None:
    from zkit_pipeline.tensor_parallel import ColumnParallelLinear

    sliced = [m for m in model.modules() if isinstance(m, ColumnParallelLinear)]
    if not sliced or any(m.weight.shape[0] * m.comm.world_size != m.out_features for m in sliced):
        return "no column-parallel linear holds a slice of its weight"
    return None


def _tied(model: torch.nn.Module) -> str | None:
    from composition_models import Embed, Head

    if hasattr(model, "ties_stages"):  # a pipeline stage: the embedding is tied across the stages
        return None if model.ties_stages else "no module is tied across the pipeline stages"
    embeds = [m for m in model.modules() if isinstance(m, Embed)]
    heads = [m for m in model.modules() if isinstance(m, Head)]
    if embeds and heads and embeds[0].wte.weight is not heads[0].lm_head.weight:
        return "the head's weight is no longer the embedding's"
    return None


def _sparse(model: torch.nn.Module) -> str | None:
    from zkit_sparse import SparseSelfAttention

    return None if any(isinstance(m, SparseSelfAttention) for m in model.modules()) else "no block-sparse attention"


def _sequence(engine: Any, model: torch.nn.Module) -> str | None:
    """Every Ulysses attention is bound to the engine's 2-rank sequence group, and the all-to-alls
    went through that group's communicator."""
    from zkit_sequence import UlyssesAttention, sequence_communicator

    comm = sequence_communicator(engine)
    if comm is None or comm.world_size != 2:
        return f"the engine's sequence-parallel communicator is {comm!r}"
    attentions = [m for m in model.modules() if isinstance(m, UlyssesAttention)]
    if not attentions or any(m.comm is not comm for m in attentions):
        return f"{len(attentions)} Ulysses attention modules, not every one bound to the sequence group"
    calls = comm.stats().get("all_to_all", {}).get("calls", 0)
    return None if calls > 0 else "no all-to-all went through the sequence group's communicator"


def _overlap_gather(engine: Any, run: dict) -> str | None:
    """At stages 1-2 over several replicas the parameters were gathered in the background and
    waited for (composition_ranks.count_gathers); elsewhere the setting has no effect, as
    documented: there is nothing to gather after the step."""
    p, counts = _partitioner(engine), run["gathers"]
    applies = p.stage in (1, 2) and p.world > 1
    if counts["refresh"][-1] != applies:
        return f"background gathers {counts['refresh'][-1]} at stage {p.stage} over {p.world} replicas"
    if applies and (counts["background"] == 0 or counts["waited"] == 0):
        return f"{counts['background']} units gathered in the background, {counts['waited']} waited for"
    return None


def _stepped_in_backward(engine: Any, run: dict) -> str | None:
    """ZeRO-Offload overlapped: the master is zkit-offload's host store that steps in backward,
    and in every engine of the cell units stepped during a batch's last backward
    (composition_ranks.count_host_steps)."""
    from zkit_offload.host_master import HostMasterStore

    store = _partitioner(engine).master_store
    if not isinstance(store, HostMasterStore):
        return f"the master store is {type(store).__name__}, not zkit-offload's overlapped host store"
    counts = run.get("host_steps", [])
    return None if counts and all(c["units"] > 0 for c in counts) else f"units stepped in backward per engine: {counts}"


def _offloaded(run: dict) -> str | None:
    """Each offload_states() call moved bytes off the device and emptied their storages."""
    calls = run.get("offloaded", [])
    if not calls:
        return "offload_states() was never called"
    for kinds, nbytes, emptied in calls:
        if not kinds or nbytes == 0 or not emptied:
            return f"offload_states() moved {nbytes} bytes of {kinds} (storages emptied: {emptied})"
    return None


def _plain_checkpoint(run: dict) -> str | None:
    """No checkpointed region needed the eager bookkeeping path (the settings in force, and no
    seeded RNG tracker to replay), and blocks were recomputed: under compile, as regions inside
    the compiled graphs (a region Dynamo cannot trace runs eagerly as a whole, at a graph break:
    then, and without compile, as forwards run in backward). Stage 3 compiles each block's forward
    alone (regional compilation, Stage3.compile_regions), which the model's checkpoint, eager
    around it, calls: there the recomputations must run the compiled block forwards."""
    from zkit.activations import recompute
    from zkit.activations.tracing import eager_reasons

    reasons = eager_reasons(recompute.settings(), None, True)
    if reasons:
        return f"the regions ran on the eager path because of {reasons}"
    backends = run.get("backends", [])
    if sum(b.regions for b in backends) > 0:
        return None
    if backends and run.get("regional") and not run.get("probed_only"):
        if sum(b.recomputed for b in backends) > 0:
            return None
        return "no compiled block forward ran as a checkpoint's recomputation in backward"
    if backends and not run.get("probed_only") and not run.get("untraceable_blocks"):
        return "no checkpointed region was traced into a compiled graph"
    return None if run["recompute"].recomputes > 0 else "no block was recomputed in backward"


def _predivided(engine: Any) -> str | None:
    p = _partitioner(engine)
    got = (getattr(p, "reduce_op", None), getattr(p, "pre_scale", None))
    return None if got == ("sum", 0.5) else f"gradients reduced with (op, pre-scale) {got}, not ('sum', 0.5)"


def _reduced_in_bf16(run: dict) -> str | None:
    """Every gradient reduction went out in bf16 (the partitioner's spied communicator,
    composition_ranks.record_reduced_dtypes), and over several replicas there were some; with one
    replica at stages 0-1 none happen, as documented: the setting has no effect there."""
    if any(d != torch.bfloat16 for d in run["comm_dtypes"]):
        return f"the partitioners reduce in {run['comm_dtypes']}"
    dtypes = set(run["reduced_dtypes"])
    if run["replicas"] == 1 and not dtypes:  # stages 0-1 on one replica reduce nothing
        return None
    return None if dtypes == {torch.bfloat16} else f"gradients were reduced in {dtypes or 'nothing'}, not bfloat16"


#: feature -> check(engine, model, run) where ``run`` holds what the run recorded (its recompute
#: counter, its allocator's count, the steps it took); a feature absent here leaves no trace to check
CHECKS: dict[str, Callable[[Any, torch.nn.Module, dict], str | None]] = {
    **{f: (lambda stage: lambda e, m, r: _stage(e, stage))(s) for f, s in STAGES.items()},
    "cpu_offload": lambda e, m, r: _host_allocator(e, "master"),
    "nvme_offload": lambda e, m, r: _host_allocator(e, "master") or _nvme(e),
    "step_in_backward": lambda e, m, r: (None if e.partitioner.master_store.step_in_backward
                                         else "the master store does not step in backward") or _nvme(e),
    "cpu_step_in_backward": lambda e, m, r: _host_allocator(e, "master") or _stepped_in_backward(e, r),
    "param_offload": lambda e, m, r: _host_allocator(e, "param") or _stage(e, 3),
    "bf16": lambda e, m, r: _dtype(e, torch.bfloat16),
    "fp16": lambda e, m, r: _dtype(e, torch.float16) or (None if e.loss_scaler is not None and e.loss_scale > 1
                                                          else "no dynamic loss scale"),
    "grad_accum": lambda e, m, r: (None if e.gradient_accumulation_steps() == 2 * r["accum_base"]
                                   else f"{e.gradient_accumulation_steps()} micro-batches per step"),
    "clipping": lambda e, m, r: (None if (e.get_global_grad_norm() or 0) > 0.05
                                 else f"the gradient norm {e.get_global_grad_norm()} was never clipped"),
    "act_ckpt": lambda e, m, r: None if r["recompute"].recomputes > 0 else "no block was recomputed in backward",
    "act_ckpt_plain": lambda e, m, r: _plain_checkpoint(r),
    "onebit_adam": lambda e, m, r: _optimizer(e, "OneBitAdam"),
    "zeroone_adam": lambda e, m, r: _optimizer(e, "ZeroOneAdam"),
    "client_sgd": lambda e, m, r: _client_sgd(e),
    "pipeline": lambda e, m, r: None if getattr(m, "num_stages", 1) == 2 else "the model is not in 2 stages",
    "pipeline_dp": lambda e, m, r: (None if getattr(m, "num_stages", 1) == 2 and e.comm.world_size == 2
                                    else "not 2 stages x 2 replicas"),
    "save_load": lambda e, m, r: None if r.get("loaded_steps") == 2 else f"loaded at step {r.get('loaded_steps')}",
    "custom_allocator": lambda e, m, r: None if r["allocated"]() > 0 else "the custom allocator handed out nothing",
    "custom_comm": lambda e, m, r: _counting_comm(e, m, r),
    "dcp_checkpoint": lambda e, m, r: (None if r.get("dcp_format") == "dcp"
                                       else f"the saved directory loads as {r.get('dcp_format')!r}, not DCP"),
    "tensor_parallel": lambda e, m, r: _tensor_parallel(m),
    "block_sparse": lambda e, m, r: _sparse(m),
    "tied_weights": lambda e, m, r: _tied(m),
    "onebit_comm": lambda e, m, r: _compressed(e) if r["compresses"] else _onebit_comm(e),
    "compile": lambda e, m, r: ("the engine's module is not compiled" if not e.is_compiled
                                else None if sum(b.graphs for b in r["backends"]) > 0 or r.get("probed_only")
                                else "torch.compile was handed no graph"),
    "overlap_gather": lambda e, m, r: _overlap_gather(e, r),
    "offload_states": lambda e, m, r: _offloaded(r),
    "predivide": lambda e, m, r: _predivided(e),
    "comm_bf16": lambda e, m, r: _reduced_in_bf16(r),
    "sequence_parallel": lambda e, m, r: _sequence(e, m),
    # the fuzzer's features (composition_fuzz_model.py)
    "zero_init": lambda e, m, r: (None if r["init_partitioned"] or e.zero_optimization_stage() != 3
                                  else "zero.Init at stage 3 built whole parameters"),
    "param_groups": lambda e, m, r: (None if len(e.optimizer.param_groups) == 2
                                     else f"{len(e.optimizer.param_groups)} parameter groups, not 2"),
    "partial_freeze": lambda e, m, r: None if r["frozen_unchanged"] else "a frozen parameter changed",
    "lamb": lambda e, m, r: _named_optimizer(e, "Lamb"),
    "scheduler": lambda e, m, r: (None if type(e.lr_scheduler).__name__ == "WarmupLR"
                                  else f"the scheduler is {type(e.lr_scheduler).__name__}"),
    "save_mid_accum": lambda e, m, r: (None if r.get("loaded_micro_steps", 0) % 2 == 1
                                       else f"loaded at micro-step {r.get('loaded_micro_steps')}, not mid-batch"),
    "ds_import": lambda e, m, r: (None if r.get("loaded_steps") == 2
                                  else f"DeepSpeed's checkpoint loaded at step {r.get('loaded_steps')}"),
    "reshard": lambda e, m, r: (None if e.zero_optimization_stage() != r["saved_stage"]
                                else f"loaded at the stage it saved at, {r['saved_stage']}"),
}


def missing(features: tuple[str, ...], engine: Any, model: torch.nn.Module, run: dict) -> list[str]:
    """What each feature of ``features`` should have left in the run and did not."""
    out = []
    for feature in features:
        if "client_sgd" in features and feature in ("onebit_adam", "zeroone_adam", "lamb"):
            continue  # the client's optimizer wins over the config's section, as in DeepSpeed
        check = CHECKS.get(feature)
        why = check(engine, model, run) if check is not None else None
        if why:
            out.append(f"{feature}: {why}")
    return out
