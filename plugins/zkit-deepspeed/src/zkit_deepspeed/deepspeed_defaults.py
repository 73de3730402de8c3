"""DeepSpeed's defaults where they differ from zkit's, which ``deepspeed.initialize`` fills into a
config that leaves the key unset, so that a DeepSpeed script trains on the drop-in as it trains on
DeepSpeed 0.19.8.

``gradient_clipping``: DeepSpeed (>= 0.19.3, ``GRADIENT_CLIPPING_DEFAULT = 1.0`` in its
``runtime/constants.py``) clips the global gradient norm at 1.0 unless the config says otherwise;
``zkit.initialize`` does not clip unless asked (0). A config that sets the key, 0 included, is
taken as it is."""
from __future__ import annotations

from typing import Any, Mapping

#: DeepSpeed 0.19.8's values for the keys whose zkit default differs
DEEPSPEED_DEFAULTS: Mapping[str, Any] = {"gradient_clipping": 1.0}


def with_deepspeed_defaults(config: Any) -> Any:
    """``config`` with DeepSpeed's default for each key of :data:`DEEPSPEED_DEFAULTS` it leaves
    unset; a config that is not a mapping (a path that did not read) is left to the engine's loader."""
    if not isinstance(config, Mapping):
        return config
    missing = {key: value for key, value in DEEPSPEED_DEFAULTS.items() if key not in config}
    return {**config, **missing} if missing else config
