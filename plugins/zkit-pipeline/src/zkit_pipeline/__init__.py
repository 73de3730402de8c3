"""Pipeline schedules and 3D (data x pipeline x tensor) parallelism for zkit."""

__version__ = "0.1.0"

from zkit_pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: E402
from zkit_pipeline.topology import ProcessGrid  # noqa: E402

__all__ = ["LayerSpec", "PipelineModule", "ProcessGrid", "TiedLayerSpec", "__version__"]
