"""DeepSpeed names that zkit refuses: using one raises :class:`FeatureNotProvided`, whose message
names the feature and what to use instead, never a bare ``ModuleNotFoundError`` or
``AttributeError``.

A refused *module* (``REFUSED_MODULES``) is imported through the drop-in's refusing finder
(:mod:`zkit_deepspeed.refusing_finder`), which raises at import. Feature probes still see it as
absent: ``importlib.util.find_spec`` answers None for it (the finder tells a probe from an
import), and ``FeatureNotProvided`` is an
``ImportError``, which ``try: import ... except ImportError`` probes catch. A refused
*attribute* of a module zkit provides (``REFUSED_NAMES``) raises from that module's
``__getattr__`` (see :func:`module_getattr`); ``hasattr`` on it raises too, rather than
answering False, so that the message is seen.
"""
from __future__ import annotations

from typing import Any, Callable

import attrs


class FeatureNotProvided(ImportError):
    """A DeepSpeed feature that zkit does not provide; the message says what to use instead."""


@attrs.frozen
class Refusal:
    feature: str  #: what DeepSpeed's name does, in a few words
    instead: str  #: what to use with zkit

    def message(self, name: str) -> str:
        return f"{name} ({self.feature}) is not provided by zkit: {self.instead}"


_DS_INFERENCE = Refusal("DeepSpeed-Inference: kernel injection and tensor-parallel inference",
                        "evaluate with an engine built without an optimizer, or the plain model")
_MOE = Refusal("mixture-of-experts layers and expert parallelism",
               "train the model without MoE layers, or with DeepSpeed")
_SEQUENCE_PARALLEL = Refusal("ALST's tiled autograd functions",
                             "build the model's attention with zkit-sequence's 'ulysses' record and set "
                             "sequence_parallel_size (zkit_sequence.TiledMLP and SequenceParallelCrossEntropy(tiles) "
                             "for the tiling), or use deepspeed.sequence.layer.DistributedAttention")
_SEQUENCE_EXTRAS = Refusal("DeepSpeed's FPDT, AutoSP and vocabulary-parallel cross-entropy around Ulysses",
                           "use deepspeed.sequence.layer.DistributedAttention, or zkit-sequence's attention and "
                           "sequence_cross_entropy")
_COMPRESSION = Refusal("DeepSpeed Compression (quantization-aware training, pruning; removed from DeepSpeed "
                       "0.19.8)", "use torch.ao.quantization or a library such as torchao")
#: the compression library's modules (its helper module stays, for recursive_getattr / recursive_setattr)
_COMPRESSION_MODULES = ("basic_layer", "compress", "config", "constants", "scheduler", "utils")
#: the compression functions that were in deepspeed.compression.helper
_COMPRESSION_HELPERS = ("module_replacement", "is_module_compressible", "compression_preparation",
                        "fix_compression", "convert_conv1d_to_linear", "generate_pruners", "register_on_step_begin", "rewrite_optimizer_step")
#: what deepspeed.compression itself exported
_COMPRESSION_EXPORTS = ("init_compression", "redundancy_clean", "compression_scheduler", "convert_conv1d_to_linear")
_COMPILED_OPS = Refusal("DeepSpeed's compiled CUDA/C++ transformer kernels",
                        "use torch's layers (torch.nn.TransformerEncoderLayer, scaled_dot_product_attention)")
_DEEPCOMPILE = Refusal("DeepCompile graph passes", "use torch.compile on the model")
_FAST_IO = Refusal("DeepSpeed's fast file writers over its async I/O op",
                   "write with torch.save; zkit-offload's NVMe offload does its own I/O")
_DATA_PIPELINE = Refusal("DeepSpeed's data-efficiency pipeline (curriculum learning, random-LTD, data analyzer)",
                         "feed the engine an ordinary DataLoader")

_ZERO3_INTERNALS = Refusal("DeepSpeed's ZeRO-3 module hooks and parameter wrappers",
                          "zkit's stage 3 gathers a partitioned parameter when it is used; nothing to install")
_PIPE_INTERNALS = Refusal("DeepSpeed's pipeline-engine internals (schedules, topology)",
                          "build a deepspeed.pipe.PipelineModule; zkit-pipeline's schedules and ProcessGrid run it")
_FP16_WRAPPERS = Refusal("DeepSpeed's FP16 optimizer wrappers",
                         "set fp16.enabled or bf16.enabled in the config: the engine keeps fp32 masters and scales "
                         "the loss")
_SPARSE_TRITON = Refusal("DeepSpeed's Triton sparse-attention modules",
                         "configure the \"sparse_attention\" section (zkit-sparse) and keep the model's attention")

#: ``deepspeed.X`` modules that raise at import (every name under them as well)
REFUSED_MODULES: dict[str, Refusal] = {
    "deepspeed.elasticity": Refusal("DeepSpeed's elastic batch-size configuration",
                                    "set train_batch_size for the world you launch; `zkit run` restarts failed "
                                    "workers with torchrun's elastic agent"),
    "deepspeed.launcher.multinode_runner": Refusal("DeepSpeed's multi-node runners (pdsh, OpenMPI, MVAPICH, Slurm)",
                                                   "run `zkit run --nnodes N --node-rank R --master-addr A` on "
                                                   "each node"),
    "deepspeed.runtime.pipe": _PIPE_INTERNALS,
    "deepspeed.runtime.precision_config": Refusal("DeepSpeed's precision-section parsers",
                                                  "read fp16_enabled / bfloat16_enabled of "
                                                  "deepspeed.runtime.config.DeepSpeedConfig"),
    "deepspeed.runtime.swap_tensor": Refusal("DeepSpeed's NVMe tensor-swapping internals",
                                             "zkit-offload's NVMe offload (offload_optimizer / offload_param device "
                                             "\"nvme\")"),
    "deepspeed.runtime.zero.parameter_offload": _ZERO3_INTERNALS,
    "deepspeed.runtime.zero.tiling": Refusal("TiledLinear (a linear layer split into tiles for ZeRO-3)",
                                             "use torch.nn.Linear; to gather less at a time at stage 3, set "
                                             "zero_optimization.stage3_gather_unit to 'module' (one unit per "
                                             "module; the default, 'block', gathers a transformer block)"),
    "deepspeed.runtime.zero.mics": Refusal("MiCS (ZeRO-3 sharding within sub-groups)",
                                           "use zero_optimization.stage 3 over the whole data-parallel world"),
    "deepspeed.runtime.domino": Refusal("Domino tensor-parallel transformer blocks",
                                        "use zkit-pipeline's tensor parallelism"),
    "deepspeed.inference": _DS_INFERENCE,
    "deepspeed.module_inject": _DS_INFERENCE,
    "deepspeed.moe.sharded_moe": _MOE,
    **{f"deepspeed.sequence.{m}": _SEQUENCE_EXTRAS for m in ("fpdt_layer", "cross_entropy", "auto_sp",
                                                             "autosp_detector", "autosp_fusion", "autosp_vit")},
    **{f"deepspeed.compression.{m}": _COMPRESSION for m in _COMPRESSION_MODULES},
    "deepspeed.ops.transformer": _COMPILED_OPS,
    "deepspeed.io": _FAST_IO,
    "deepspeed.compile": _DEEPCOMPILE,
    "deepspeed.runtime.data_pipeline": _DATA_PIPELINE,
}

#: attributes of modules zkit provides that raise when read
REFUSED_NAMES: dict[str, Refusal] = {
    **{f"deepspeed.runtime.sequence_parallel.ulysses_sp.{name}": _SEQUENCE_PARALLEL
       for name in ("SequenceTiledCompute", "sequence_tiled_compute", "TiledMLP",
                    "TiledFusedLogitsLoss", "TiledLoss", "AutogradComputeMLP", "UlyssesSPFwdLossBwdWithLogits")},
    "deepspeed.DeepSpeedTransformerLayer": _COMPILED_OPS,
    "deepspeed.DeepSpeedTransformerConfig": _COMPILED_OPS,
    "deepspeed.replace_transformer_layer": _DS_INFERENCE,
    "deepspeed.zero.MiCS_Init": Refusal("MiCS (ZeRO-3 sharding within sub-groups)", "use deepspeed.zero.Init"),
    "deepspeed.runtime.zero.MiCS_Init": Refusal("MiCS (ZeRO-3 sharding within sub-groups)", "use deepspeed.zero.Init"),
    "deepspeed.runtime.zero.partition_parameters.InsertPostInitMethodToModuleSubClasses": _ZERO3_INTERNALS,
    "deepspeed.runtime.zero.partition_parameters.zero3_linear_wrap": _ZERO3_INTERNALS,
    "deepspeed.ops.sparse_attention.SparseSelfAttention": _SPARSE_TRITON,
    "deepspeed.ops.sparse_attention.BertSparseSelfAttention": _SPARSE_TRITON,
    "deepspeed.ops.sparse_attention.SparseAttentionUtils": _SPARSE_TRITON,
    "deepspeed.runtime.utils.CheckOverflow": _FP16_WRAPPERS,
    "deepspeed.runtime.utils.clip_grad_norm_": Refusal("DeepSpeed's expert-aware gradient clipping",
                                                       "set gradient_clipping in the config, or call "
                                                       "torch.nn.utils.clip_grad_norm_"),
    "deepspeed.runtime.utils.get_weight_norm": Refusal("DeepSpeed's model-parallel weight norm",
                                                       "compute torch.linalg.vector_norm over the parameters (gathered "
                                                       "with deepspeed.zero.GatheredParameters at stage 3)"),
    "deepspeed.runtime.utils.count_used_parameters_in_backward": _ZERO3_INTERNALS,
    "deepspeed.utils.numa.get_numactl_cmd": Refusal("the launcher's NUMA binding",
                                                    "bind with numactl around `zkit run`"),
    "deepspeed.comm.TorchBackend": Refusal("DeepSpeed's communication-backend class",
                                           "call deepspeed.comm's functions (torch.distributed underneath)"),
    **{f"deepspeed.compression.helper.{f}": _COMPRESSION for f in _COMPRESSION_HELPERS},
    **{f"deepspeed.compression.{f}": _COMPRESSION for f in _COMPRESSION_EXPORTS},
    "deepspeed.tp_model_init": Refusal("DeepSpeed's AutoTP training", "use zkit-pipeline's tensor parallelism "
                                                                      "(zkit_pipeline.tensor)"),
}


def refusal_for(name: str) -> Refusal | None:
    """The refusal of ``name`` or of a module it is inside, if any."""
    if name in REFUSED_NAMES:
        return REFUSED_NAMES[name]
    parts = name.split(".")
    for i in range(len(parts), 1, -1):
        refusal = REFUSED_MODULES.get(".".join(parts[:i]))
        if refusal is not None:
            return refusal
    return None


def refuse(name: str) -> FeatureNotProvided:
    refusal = refusal_for(name)
    assert refusal is not None, name
    return FeatureNotProvided(refusal.message(name), name=name)


def module_getattr(module_name: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``deepspeed.X``: refused names raise
    :class:`FeatureNotProvided`, others the usual ``AttributeError``."""
    public = module_name

    def __getattr__(attr: str) -> Any:
        full = f"{public}.{attr}"
        if refusal_for(full) is not None:
            raise refuse(full)
        raise AttributeError(f"module {public!r} has no attribute {attr!r}")

    return __getattr__
