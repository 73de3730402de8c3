"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` (zkit-offload's CPU Adam, DeepSpeed's signature
and defaults) and ``FusedAdam`` (torch's fused Adam/AdamW)."""
from zkit.compat.deepspeed.ops.adam.cpu_adam import DeepSpeedCPUAdam
from zkit.compat.deepspeed.ops.adam.fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
