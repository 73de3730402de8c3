"""ZeRO: the partitioners of zkit's default stages, and the stage-3 tools for user code."""
from zkit.zero.init import GatheredParameters, Init
from zkit.zero.sharded_params import ZeroParameter

__all__ = ["GatheredParameters", "Init", "ZeroParameter"]
