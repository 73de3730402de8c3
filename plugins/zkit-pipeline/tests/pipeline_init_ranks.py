"""Rank function of test_pipeline_under_init.py: a 2-stage pipeline built under zkit.zero.Init,
its layers given as LayerSpecs or as modules built there, its stages sharing a tied module."""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

import zkit
from zkit_pipeline import LayerSpec, PipelineModule, TiedLayerSpec

CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1}}


class OverlappingBroadcast(RuntimeError):
    """A broadcast into a tensor whose elements share memory (a released Init parameter's
    placeholder, one element expanded to the parameter's shape): gloo would write past it."""


def _layers(specs: bool) -> list:
    if specs:
        return [TiedLayerSpec("t", nn.Linear, 8, 8), LayerSpec(nn.Linear, 8, 8), LayerSpec(nn.Linear, 8, 8),
                TiedLayerSpec("t", nn.Linear, 8, 8)]
    tied = nn.Linear(8, 8)

    class Prebuilt(TiedLayerSpec):  # the tied module built with the others, under Init
        def build(self) -> nn.Module:
            return tied

    return [Prebuilt("t", nn.Linear), nn.Linear(8, 8), nn.Linear(8, 8), Prebuilt("t", nn.Linear)]


def pipeline_under_init(specs: bool) -> dict:
    real = dist.broadcast

    def watched(tensor, *args, **kwargs):
        if tensor.numel() > 1 and not tensor.is_contiguous():
            raise OverlappingBroadcast(f"broadcast into a {tuple(tensor.shape)} tensor with strides {tensor.stride()}")
        return real(tensor, *args, **kwargs)

    dist.broadcast = watched
    try:
        with zkit.zero.Init(config_dict_or_path=CONFIG):
            module = PipelineModule(_layers(specs), num_stages=2, loss_fn=nn.functional.mse_loss)
        zkit.initialize(model=module, config=CONFIG)
    except (OverlappingBroadcast, ValueError) as exc:
        return {"raised": f"{type(exc).__name__}: {exc}"}
    finally:
        dist.broadcast = real
    return {"accepted": True}
