"""``deepspeed.utils``: the logger, rank-filtered logging, and helpers scripts import from it
(full-parameter access: :mod:`.tensor_fragment`; ZeRO-3 leaf marks: :mod:`.z3_leaf_module`;
submodules by dotted name: :mod:`.module_utils`)."""
from __future__ import annotations

from deepspeed.utils.logging import log_dist, logger, print_dist  # also makes .logging DeepSpeed's module
from zkit.data import RepeatingLoader

from deepspeed.utils import groups  # noqa: E402 - reached as deepspeed.utils.groups
from deepspeed.utils.module_utils import recursive_getattr, recursive_setattr
from deepspeed.utils.tensor_fragment import *  # noqa: F401,F403
from deepspeed.utils.tensor_fragment import __all__ as _tensor_fragment
from deepspeed.utils.z3_leaf_module import *  # noqa: F401,F403
from deepspeed.utils.z3_leaf_module import __all__ as _z3_leaf_module

__all__ = ["RepeatingLoader", "groups", "log_dist", "logger", "print_dist", "recursive_getattr",
           "recursive_setattr", *_tensor_fragment, *_z3_leaf_module]
