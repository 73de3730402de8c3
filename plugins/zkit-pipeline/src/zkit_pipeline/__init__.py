"""Pipeline schedules and 3D (data x pipeline x tensor) parallelism for zkit."""

__version__ = "0.1.0"

from zkit_pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: E402
from zkit_pipeline.tensor_parallel.module import TensorParallelModule  # noqa: E402
from zkit_pipeline.topology import ProcessGrid  # noqa: E402
from zkit_pipeline.engine_api import eval_batch  # noqa: E402


__all__ = ["LayerSpec", "PipelineModule", "ProcessGrid", "TensorParallelModule", "TiedLayerSpec", "__version__", "eval_batch"]
