"""The drop-in's optional dependencies: zkit's plugins behind some ``deepspeed`` names.

``deepspeed.pipe`` is zkit-pipeline, ``deepspeed.ops.adam.DeepSpeedCPUAdam`` (and the CPU Lion and
Adagrad) zkit-offload, ``deepspeed.ops.sparse_attention`` zkit-sparse, ``deepspeed.sequence.layer`` and
``deepspeed.runtime.sequence_parallel`` zkit-sequence. They are extras of the
``deepspeed`` distribution (``pip install 'deepspeed[pipeline,offload,sparse]'``, or each plugin by
its own name); without one, importing the name that needs it raises an ``ImportError`` naming
the distribution to install, as DeepSpeed's ops raise when their extension is not built.
"""
from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

#: top-level module -> (distribution, extra of the ``deepspeed`` distribution)
OPTIONAL_PLUGINS = {
    "zkit_offload": ("zkit-offload", "offload"),
    "zkit_pipeline": ("zkit-pipeline", "pipeline"),
    "zkit_sparse": ("zkit-sparse", "sparse"),
    "zkit_sequence": ("zkit-sequence", "sequence"),
}


class MissingPlugin(ImportError):
    """A ``deepspeed`` name needs a zkit plugin that is not installed."""


def import_plugin(module: str, needed_by: str) -> ModuleType:
    """Import ``module`` (of one of :data:`OPTIONAL_PLUGINS`) for ``needed_by``, a ``deepspeed``
    name. Only the plugin's absence becomes :class:`MissingPlugin`; an error raised inside an
    installed plugin propagates as it is."""
    top = module.split(".")[0]
    distribution, extra = OPTIONAL_PLUGINS[top]
    if importlib.util.find_spec(top) is None:
        raise MissingPlugin(
            f"{needed_by} needs {distribution}, which is not installed: pip install {distribution} "
            f"(or the drop-in with its extra, pip install 'deepspeed[{extra}]')",
            name=top,
        )
    return importlib.import_module(module)
