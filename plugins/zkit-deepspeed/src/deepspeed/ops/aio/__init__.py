"""``deepspeed.ops.aio``: DeepSpeed's async I/O op, whose builder says it is not there (zkit-offload's
NVMe offload does its own I/O)."""
from deepspeed.ops.op_builder import AsyncIOBuilder

__all__ = ["AsyncIOBuilder"]
