"""DeepSpeed's sections for features zkit does not have: ``amp`` (NVIDIA Apex), ``elasticity``,
``autotuning`` and ``hybrid_engine`` (RLHF generation). A DeepSpeed config names them with the feature off, so they are read and validated
like any section; turning one on is refused at initialize, naming the key. Registered by
:mod:`zkit.deepspeed_only.plugin`."""
from typing import ClassVar

import attrs

from zkit.core.config.fields import at_least, each, one_of, setting


@attrs.frozen(kw_only=True)
class AmpConfig:
    """NVIDIA Apex AMP. Every key besides ``enabled`` is an ``amp.initialize`` argument."""

    #: keys other than ``enabled`` are collected into this field (they are Apex's arguments)
    extra_keys_into: ClassVar[str] = "options"

    enabled: bool = setting(False, unimplemented=True, doc="Use Apex AMP.")
    options: dict = setting(
        attrs.Factory(dict), default_doc="{}", doc="Other keys: arguments of amp.initialize."
    )


@attrs.frozen(kw_only=True)
class ElasticityConfig:
    """Choose a batch size that works for a range of GPU counts."""

    enabled: bool = setting(False, unimplemented=True, doc="Elastic training.")
    max_train_batch_size: int = setting(2000, check=at_least(1), doc="Largest global batch.")
    micro_batch_sizes: tuple[int, ...] = setting(
        (2, 4, 6), check=each(at_least(1)), default_doc="[2, 4, 6]", doc="Allowed micro-batches."
    )
    min_gpus: int = setting(1, check=at_least(1), doc="Fewest GPUs to plan for.")
    max_gpus: int = setting(10000, check=at_least(1), doc="Most GPUs to plan for.")
    min_time: int = setting(0, check=at_least(0), doc="Minutes before rescaling (0: unknown).")
    prefer_larger_batch: bool = setting(True, doc="Prefer the larger of equal choices.")
    ignore_non_elastic_batch_info: bool = setting(
        False, doc="Ignore batch keys outside this section."
    )
    version: float = setting(0.2, doc="Version of the elastic algorithm.")
    model_parallel_size: int = setting(1, check=at_least(1), doc="Model-parallel degree.")
    num_gpus_per_node: int = setting(1, check=at_least(1), doc="GPUs per node.")


@attrs.frozen(kw_only=True)
class AutotuningConfig:
    """Search ZeRO stages and micro-batch sizes for the fastest setting."""

    enabled: bool = setting(False, unimplemented=True, doc="Run the autotuner.")
    fast: bool = setting(True, doc="Tune only the micro-batch size per stage.")
    results_dir: str = setting("autotuning_results", doc="Where results are written.")
    exps_dir: str = setting("autotuning_exps", doc="Where experiment configs are written.")
    overwrite: bool = setting(True, doc="Overwrite earlier results.")
    metric: str = setting(
        "throughput", check=one_of(("latency", "throughput", "flops")), doc="What to optimize."
    )
    start_profile_step: int = setting(3, check=at_least(0), doc="First profiled step.")
    end_profile_step: int = setting(5, check=at_least(0), doc="Last profiled step.")
    metric_path: str | None = setting(None, doc="File the metric is read from.")
    tuner_type: str = setting(
        "gridsearch",
        check=one_of(("gridsearch", "random", "model_based")),
        doc="Search strategy.",
    )
    tuner_early_stopping: int = setting(5, check=at_least(1), doc="Trials without improvement.")
    tuner_num_trials: int = setting(50, check=at_least(1), doc="Most trials.")
    arg_mappings: dict | None = setting(None, doc="Config keys -> launcher arguments.")
    model_info: dict | None = setting(None, doc="Model size information.")
    model_info_path: str | None = setting(None, doc="File with model size information.")
    max_train_batch_size: int | None = setting(None, check=at_least(1), doc="Largest batch.")
    min_train_batch_size: int = setting(1, check=at_least(1), doc="Smallest batch.")
    max_train_micro_batch_size_per_gpu: int = setting(
        1024, check=at_least(1), doc="Largest micro-batch."
    )
    min_train_micro_batch_size_per_gpu: int = setting(
        1, check=at_least(1), doc="Smallest micro-batch."
    )
    num_tuning_micro_batch_sizes: int = setting(3, check=at_least(1), doc="Micro-batches tried.")
    mp_size: int = setting(1, check=at_least(1), doc="Model-parallel degree.")


@attrs.frozen(kw_only=True)
class HybridEngineConfig:
    """DeepSpeed's hybrid engine: the training engine switching to inference kernels to generate
    (RLHF's experience generation). DeepSpeed-Chat writes this section at every step, off below
    step 3."""

    enabled: bool = setting(
        False, unimplemented=True,
        doc="RLHF generation with DeepSpeed's hybrid engine (inference kernels inside the training engine).",
    )
    max_out_tokens: int = setting(512, check=at_least(1), doc="Longest generated sequence.")
    inference_tp_size: int = setting(1, check=at_least(1), doc="Tensor-parallel degree of generation.")
    release_inference_cache: bool = setting(False, doc="Free the inference cache after generating.")
    pin_parameters: bool = setting(True, doc="Pin the gathered parameters in memory.")
    tp_gather_partition_size: int = setting(8, check=at_least(1), doc="Ranks gathered at once.")
    enable_cuda_graph: bool = setting(False, doc="Capture generation in CUDA graphs.")
