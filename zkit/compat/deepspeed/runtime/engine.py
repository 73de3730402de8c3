"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is :class:`zkit.engine.Engine` (the class
``deepspeed.initialize`` returns an instance of, so ``isinstance`` checks hold)."""
from zkit.engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
