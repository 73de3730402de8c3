"""The hook implementations zkit discovers through the entry point ``example``."""
from __future__ import annotations

import warnings

import zkit
from zkit.core.records import ConfigSectionRecord, OptimizerRecord
from zkit_example_plugin.section import GradNormWatchConfig
from zkit_example_plugin.signum import Signum
from zkit_example_plugin.watch import HISTORY, NormHistory

SECTION = "grad_norm_watch"


@zkit.hookimpl
def zkit_register_optimizers():
    yield OptimizerRecord(
        name="signum",
        factory=Signum,
        state_names=("momentum_buffer",),  # lets every ZeRO stage shard and checkpoint it
        elementwise=True,
        description="sign of momentum (Signum); an example third-party plugin",
    )


@zkit.hookimpl
def zkit_config_sections():
    yield ConfigSectionRecord(path=SECTION, schema=GradNormWatchConfig,
                              description="record the global gradient norm of every step")


@zkit.hookimpl
def zkit_engine_setup(engine):
    config = engine.config.section(SECTION)
    if config is None:
        return
    engine.stash[HISTORY] = NormHistory(config)
    engine.track_grad_norm = True  # the engine computes the norm only when someone needs it


@zkit.hookimpl(wrapper=True)
def zkit_grad_norm(step):
    # A wrapper sees the norm the other implementations agreed on (zkit-pipeline's grid-wide sum,
    # zkit-onebit's average) and passes it on unchanged.
    norm = yield
    history = step.stash.get(HISTORY, None)
    if history is not None and step.number % history.config.every == 0:
        value = float(norm) / step.loss_scaler.scale
        history.norms.append((step.number, value))
        limit = history.config.warn_above
        if limit is not None and value > limit:
            warnings.warn(f"step {step.number}: gradient norm {value:.4g} is above grad_norm_watch.warn_above={limit}",
                          stacklevel=2)
    return norm


@zkit.hookimpl
def zkit_report():
    yield "zkit-example-plugin", "Signum optimizer registered; grad_norm_watch section"
