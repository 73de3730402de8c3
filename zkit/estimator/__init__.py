"""The parts of ``zkit estimate`` (the public API is :mod:`zkit.estimator.command`)."""
from zkit.estimator.activations import gpt_activation_bytes
from zkit.zero import OFFLOADS, STAGES, StateBytes, model_state_bytes, stage3_plan, stage3_units

__all__ = ["OFFLOADS", "STAGES", "StateBytes", "gpt_activation_bytes", "model_state_bytes", "stage3_plan", "stage3_units"]
