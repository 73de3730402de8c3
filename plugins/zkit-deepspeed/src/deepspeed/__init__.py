"""``deepspeed``, provided by zkit (the distribution ``deepspeed 0.19.8+zkit`` from zkit's
``plugins/zkit-deepspeed``): DeepSpeed's public names on zkit, so unmodified code written for
DeepSpeed (Hugging Face Trainer and Accelerate included) trains on zkit's engine.

A thin layer: every name maps onto zkit's own API, with DeepSpeed's signatures and semantics
(DeepSpeed 0.19.8's). ``initialize`` builds a :class:`zkit.core.engine.Engine`; ``comm`` is
``torch.distributed`` under DeepSpeed's names (:mod:`deepspeed.comm.comm`); ``zero`` is
:mod:`zkit.zero` plus DeepSpeed's extra names; ``accelerator`` is the device this process trains
on (:mod:`deepspeed.accelerator.real_accelerator`); ``pipe`` and the CPU optimizers in ``ops``
come from zkit-pipeline and zkit-offload, optional dependencies (:mod:`zkit_deepspeed.optional`).
What zkit does not do (``init_inference``, an ``mpu=`` other than DeepSpeed's
sequence-parallel groups) is refused with a message, never accepted
and ignored. See ``docs/migrating-from-deepspeed.md``.

This replaces a real DeepSpeed install; ``pip uninstall deepspeed && pip install deepspeed``
switches back. ``zkit report`` says which one is active.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable

import torch

from deepspeed import accelerator, checkpointing, comm, moe, ops, runtime, utils, zero
from deepspeed.accelerator import get_accelerator
from deepspeed.on_device import OnDevice
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import log_dist, logger
from deepspeed.refused import module_getattr
from deepspeed.comm.comm import TORCH_DISTRIBUTED_DEFAULT_PORT, init_distributed
from zkit_deepspeed import refusing_finder
from zkit_deepspeed.deepspeed_defaults import with_deepspeed_defaults
from zkit_deepspeed.ignored_keys import drop_ignored_keys
from zkit_deepspeed.sequence_mpu import building_with, sequence_mpu, with_sequence_parallel_size

refusing_finder.install()  # importing a refused deepspeed.X raises FeatureNotProvided

# names zkit refuses (deepspeed.DeepSpeedTransformerLayer, ...) raise FeatureNotProvided, see refused.py
__getattr__ = module_getattr(__name__)

__version__ = "0.19.8+zkit"  # DeepSpeed's release whose API this follows, labelled as zkit's
__version_major__, __version_minor__, __version_patch__ = 0, 19, 8
version = __version__
__git_hash__ = __git_branch__ = None

__all__ = [
    "DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedEngine", "OnDevice", "TORCH_DISTRIBUTED_DEFAULT_PORT",
    "accelerator",
    "add_config_arguments", "checkpointing", "comm", "get_accelerator", "init_distributed", "init_inference",
    "initialize", "log_dist", "logger", "moe", "ops", "runtime", "utils", "zero",
]


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """``deepspeed.initialize``: DeepSpeed's signature (``args`` first); returns ``(engine,
    optimizer, training_dataloader, lr_scheduler)``. The config comes from ``config``, else
    ``config_params``, else ``args.deepspeed_config`` (or the older ``args.deepscale_config``);
    giving it both in ``config`` and in ``args`` is an error, as in DeepSpeed. Keys DeepSpeed
    ignores where they have no effect (``offload_param`` below stage 3) are ignored with one
    warning (:mod:`zkit_deepspeed.ignored_keys`). A key whose DeepSpeed default differs from
    zkit's takes DeepSpeed's when the config leaves it unset: ``gradient_clipping`` 1.0
    (:mod:`zkit_deepspeed.deepspeed_defaults`)."""
    from zkit.core.engine import initialize as zkit_initialize

    if mesh_param is not None:
        raise ValueError("deepspeed.initialize(mesh_param=...) is not supported: zkit-pipeline's ProcessGrid builds "
                         "the data/pipeline/tensor mesh")
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        config = config_params
    if config is not None and from_args is not None:
        raise ValueError("deepspeed.initialize: the config was given twice, in config= and in "
                         "args.deepspeed_config; give one")
    if config is None:
        config = from_args
    config = with_deepspeed_defaults(drop_ignored_keys(config))
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    # DeepSpeed's sequence-parallel groups (Accelerate's and the Trainer's Ulysses) become the
    # engine's sequence_parallel_size; any other mpu= is refused by zkit's initialize
    sequence = sequence_mpu(mpu)
    if sequence is not None:
        config = with_sequence_parallel_size(config, sequence.get_sequence_parallel_world_size())
        mpu = None
    with building_with(sequence):
        result = zkit_initialize(model=model, optimizer=optimizer, model_parameters=model_parameters,
                                 training_data=training_data, lr_scheduler=lr_scheduler, config=config,
                                 collate_fn=collate_fn, mpu=mpu, engine_class=DeepSpeedEngine)
    from deepspeed.utils import groups

    groups._set_sequence_parallel_group(result[0].sequence_parallel_group, sequence)
    if result[0].zero_optimization_stage() == 3:
        # DeepSpeed's ZeRO-3 keeps each module's ``_external_params``; code written for it reads them
        from deepspeed.runtime.zero.external_params import track_returned_params

        track_returned_params(result[0].module)
    return result


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line flags (``--deepspeed``, ``--deepspeed_config``, and the older
    ``--deepscale``, ``--deepscale_config``) to ``parser``, in a group named ``DeepSpeed``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help="Deprecated: as --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated: as --deepspeed_config")
    return parser


def init_inference(model: torch.nn.Module, config: Any = None, **kwargs: Any) -> Any:
    """Refused: zkit trains; DeepSpeed-Inference (kernel injection, tensor-parallel inference) is
    not part of it."""
    raise NotImplementedError(
        "deepspeed.init_inference is not supported by zkit (DeepSpeed-Inference's kernel injection is out of scope): "
        "for evaluation, build an engine without an optimizer (deepspeed.initialize(model=..., config=...)) and call "
        "engine.eval() / engine(inputs), or run the plain model"
    )
