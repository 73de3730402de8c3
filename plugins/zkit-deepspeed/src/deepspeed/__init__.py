"""``deepspeed``, provided by zkit (the distribution ``deepspeed 0.19.8+zkit`` from zkit's
``plugins/zkit-deepspeed``): ``import deepspeed`` gives ``zkit.compat.deepspeed``, and
``deepspeed.X`` gives ``zkit.compat.deepspeed.X``, the very same module objects. Unmodified code
written for DeepSpeed (Hugging Face Trainer and Accelerate included) then trains on zkit's engine.

This replaces a real DeepSpeed install; ``pip uninstall deepspeed && pip install deepspeed``
switches back. ``zkit report`` says which one is active.
"""
import sys

from zkit_deepspeed.alias import install

install()  # sys.modules["deepspeed"] is now zkit.compat.deepspeed: the import returns that module
del sys, install
