"""``deepspeed.compression.helper``: the old home of ``recursive_getattr`` and
``recursive_setattr`` (now :mod:`deepspeed.utils.module_utils`). Importing it warns, with
DeepSpeed 0.19.8's ``FutureWarning``, that they moved; the compression helpers that were beside
them are refused (``deepspeed.refused``)."""
import warnings

from deepspeed.refused import module_getattr
from deepspeed.utils.module_utils import recursive_getattr, recursive_setattr

warnings.warn("deepspeed.compression.helper is deprecated; import recursive_getattr and recursive_setattr from "
              "deepspeed.utils.module_utils instead", FutureWarning, stacklevel=2)

__all__ = ["recursive_getattr", "recursive_setattr"]
__getattr__ = module_getattr(__name__)
