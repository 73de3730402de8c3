"""``deepspeed.constants``: the launcher's and the process group's constants scripts read."""
from deepspeed.comm.comm import TORCH_DISTRIBUTED_DEFAULT_PORT

#: environment variables DeepSpeed's multi-node launcher sets (node rank, node count)
CROSS_RANK = "CROSS_RANK"
CROSS_SIZE = "CROSS_SIZE"
LOCAL_RANK = "LOCAL_RANK"

__all__ = ["CROSS_RANK", "CROSS_SIZE", "LOCAL_RANK", "TORCH_DISTRIBUTED_DEFAULT_PORT"]
