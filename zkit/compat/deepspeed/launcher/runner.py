"""``deepspeed.launcher.runner``: the names other launchers import from DeepSpeed's.

Accelerate's ``accelerate launch --use_deepspeed`` imports ``DEEPSPEED_ENVIRONMENT_NAME`` (the
file of environment variables DeepSpeed's multi-node launcher exports to every node) before it
starts the ranks itself.
"""
from __future__ import annotations

import os

#: DeepSpeed's name for the per-job environment file (``DS_ENV_FILE`` overrides it, as there)
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
