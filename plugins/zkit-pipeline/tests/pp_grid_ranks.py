"""Rank functions of the checkpoint, eval_batch and 3D tests (module level so spawned ranks can
import them). Each job runs several cases: starting ranks costs more than the training."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zkit
from pp_engine_ranks import config, untied_layers
from pp_ranks import WIDTH
from zkit.checkpoint import CheckpointError, consolidate
from zkit_pipeline import PipelineModule, eval_batch
from zkit_pipeline.gpt_runs import (
    make_data,
    tensor_parallel_engine,
    train_dense,
    train_pipeline,
    train_steps,
    train_tensor_parallel,
)
from zkit_pipeline.tp_gpt import TensorParallelGPTConfig

MICRO, BATCH, STAGES = 2, 2, 2
GPT = TensorParallelGPTConfig(vocab_size=64, seq_len=8, d_model=32, n_heads=4, n_layers=2)
GPT_STEPS, GPT_LR, GPT_CLIP = 3, 3e-3, 0.5


def batches(count: int, replica: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``count`` global batches of ``MICRO`` micro-batches for one replica (same on every world size)."""
    gen = torch.Generator().manual_seed(100 + replica)
    return [[(torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen))
             for _ in range(MICRO)] for _ in range(count)]


def _engine(stage: int, num_stages: int = STAGES) -> tuple[Any, int]:
    module = PipelineModule(untied_layers(), num_stages, F.mse_loss, partition_method="uniform")
    cfg = {**config(stage), "gradient_accumulation_steps": MICRO}
    engine, *_ = zkit.initialize(model=module, config=cfg)
    return engine, module.grid.coord(dist.get_rank()).data


def _error(fn) -> str:
    try:
        fn()
    except CheckpointError as exc:
        return str(exc)
    return ""


def save_and_continue(path: str, stage: int) -> dict[str, Any]:
    """Train 2 batches, save, train 2 more; a fresh engine loads and trains the same 2."""
    engine, replica = _engine(stage)
    data = batches(4, replica)
    for b in data[:2]:
        engine.train_batch(iter(b))
    engine.save_checkpoint(path, tag="mid")
    after = [float(engine.train_batch(iter(b))) for b in data[2:]]
    engine.close()
    fresh, _ = _engine(stage)
    fresh.load_checkpoint(path)
    resumed = [float(fresh.train_batch(iter(b))) for b in data[2:]]
    steps = fresh.global_steps
    fresh.close()
    return {"after": after, "resumed": resumed, "global_steps": steps}


def eval_matches_forward() -> dict[str, Any]:
    engine, replica = _engine(1)
    b = batches(1, replica)[0]
    evaluated = float(engine.eval_batch(iter(b)))
    again = float(eval_batch(engine, iter(b)))
    steps = engine.global_steps
    trained = float(engine.train_batch(iter(b)))  # its loss is the forward before the update
    engine.close()
    return {"eval": evaluated, "again": again, "train": trained, "steps_after_eval": steps}


def two_ranks(path: str) -> dict[str, Any]:
    out: dict[str, Any] = {"ckpt": save_and_continue(path, stage=1), "eval": eval_matches_forward()}
    # a different stage count and an unsplit model are refused with the reason
    one_stage, _ = _engine(1, num_stages=1)
    out["stage_count_error"] = _error(lambda: one_stage.load_checkpoint(path))
    one_stage.close()
    plain, *_ = zkit.initialize(model=nn.Sequential(nn.Linear(WIDTH, WIDTH)), config=config(1))
    out["unsplit_error"] = _error(lambda: plain.load_checkpoint(path))
    plain.close()
    if dist.get_rank() == 0:
        out["consolidate_error"] = _error(lambda: consolidate(path, f"{path}/whole.pt"))
    return out


def four_ranks(path_2x1: str, path_2x2: str) -> dict[str, Any]:
    """2 stages x 2 replicas: load the 2 x 1 checkpoint (resharded to twice the data degree),
    save and resume at 2 x 2, and the GPT on both 3D layouts against dense training."""
    out: dict[str, Any] = {}
    engine, replica = _engine(1)
    engine.load_checkpoint(path_2x1)
    # every replica sees the batch the 2 x 1 run trained on after its save: same parameters, so the
    # replicas' mean (what train_batch returns) is that run's loss
    out["resharded_first_loss"] = float(engine.train_batch(iter(batches(4, 0)[2])))
    out["replica"] = replica
    engine.close()
    out["ckpt"] = save_and_continue(path_2x2, stage=2)

    data = make_data(GPT, GPT_STEPS, replicas=2, micro=MICRO, batch=BATCH)
    kw = {"lr": GPT_LR, "clip": GPT_CLIP}
    dense = train_dense(GPT, data, replica=None, **kw)  # the pipeline's train_batch: the replicas' mean
    out["dense_pipe"], out["dense_norms"] = dense.losses, dense.grad_norms
    pipe = train_pipeline(GPT, data, stages=2, zero=1, **kw)
    out["pipe"], out["pipe_norms"] = pipe.losses, pipe.grad_norms
    pipe.engine.close()
    tensor = train_tensor_parallel(GPT, data, tensor=2, zero=2, **kw)
    out["tensor"], out["tensor_norms"] = tensor.losses, tensor.grad_norms
    out["tensor_replica"] = tensor.engine.module.coord.data  # the tensor grid numbers replicas its own way
    out["dense_tensor"] = train_dense(GPT, data, replica=out["tensor_replica"], **kw).losses
    # a tensor-parallel checkpoint: one part per tensor rank, resumed exactly
    tensor.engine.save_checkpoint(f"{path_2x2}-tp", tag="t")
    more = make_data(GPT, 1, replicas=2, micro=MICRO, batch=BATCH, seed=11)
    out["tp_after"] = train_steps(tensor.engine, more, out["tensor_replica"]).losses
    tensor.engine.close()
    fresh, rep = tensor_parallel_engine(GPT, tensor=2, zero=2, micro=MICRO, batch=BATCH, **kw)
    fresh.load_checkpoint(f"{path_2x2}-tp")
    out["tp_resumed"] = train_steps(fresh, more, rep).losses
    fresh.close()
    return out
