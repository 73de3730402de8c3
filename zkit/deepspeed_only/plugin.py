"""Registers DeepSpeed's sections for features zkit does not have (:mod:`zkit.deepspeed_only.config`)."""
from __future__ import annotations

import zkit
from zkit.core.records import ConfigSectionRecord
from zkit.deepspeed_only.config import AmpConfig, AutotuningConfig, ElasticityConfig, HybridEngineConfig

SECTIONS = {"amp": (AmpConfig, "Apex AMP."), "elasticity": (ElasticityConfig, "Elastic batch sizes."),
            "autotuning": (AutotuningConfig, "Autotuner."),
            "hybrid_engine": (HybridEngineConfig, "DeepSpeed's hybrid engine (RLHF generation).")}


@zkit.hookimpl(trylast=True)
def zkit_config_sections():
    for path, (schema, description) in SECTIONS.items():
        yield ConfigSectionRecord(path=path, schema=schema, description=description, default_when_absent=True)
