"""``deepspeed.moe``: zkit has no mixture-of-experts layer or expert parallelism. The helpers
scripts import unconditionally are here, with DeepSpeed's results for models without experts;
building an ``MoE`` layer, or handing them expert parameters, is refused with a message."""
from deepspeed.moe import layer, utils  # noqa: E402 - reached as attributes (deepspeed.moe.layer.MoE)

__all__ = ["layer", "utils"]
