"""``deepspeed.pipe``: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec`` from zkit-pipeline (an
optional dependency of the drop-in: without it this import names the distribution to install)."""
from zkit_deepspeed.optional import import_plugin

_pipeline = import_plugin("zkit_pipeline", "deepspeed.pipe")
LayerSpec, PipelineModule, TiedLayerSpec = _pipeline.LayerSpec, _pipeline.PipelineModule, _pipeline.TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
