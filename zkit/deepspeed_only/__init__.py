"""Built-in plugin: DeepSpeed's config sections for features zkit does not have (``amp``,
``elasticity``, ``autotuning``, ``hybrid_engine``), so that a DeepSpeed config that names them
with the feature off loads unchanged (:mod:`zkit.deepspeed_only.config`)."""
