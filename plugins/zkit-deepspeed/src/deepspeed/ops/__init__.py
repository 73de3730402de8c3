"""``deepspeed.ops``: optimizers (``ops.adam``); block-sparse attention (``ops.sparse_attention``)
when zkit-sparse is installed; the op builders (``ops.op_builder``) and ``__compatible_ops__``,
which say which of DeepSpeed's ops zkit provides."""
from deepspeed.git_version_info import compatible_ops as __compatible_ops__  # noqa: F401
from deepspeed.refused import module_getattr

from . import adam  # noqa: F401,E402  (deepspeed.ops.adam after ``import deepspeed``, as in DeepSpeed)

__getattr__ = module_getattr(__name__)
