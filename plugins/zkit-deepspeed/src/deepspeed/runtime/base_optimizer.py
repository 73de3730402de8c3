"""``deepspeed.runtime.base_optimizer``: ``DeepSpeedOptimizer``, DeepSpeed's marker base class of
its ZeRO optimizer wrappers. zkit hands out torch optimizers (``torch.optim.Optimizer``), so code
that asks ``isinstance(x, (Optimizer, DeepSpeedOptimizer))``, as Lightning does, finds them by the
first; the class is here so that such code imports."""


class DeepSpeedOptimizer:
    """A marker base class with no behaviour, as in DeepSpeed."""
