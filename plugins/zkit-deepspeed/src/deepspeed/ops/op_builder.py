"""``deepspeed.ops.op_builder``: DeepSpeed's op builders, for the code that asks them whether an op
is there (``Builder().is_compatible()``, ``deepspeed.ops.__compatible_ops__[Builder.NAME]``).

zkit compiles no DeepSpeed op. A builder is *compatible* where zkit provides the op's Python API
(``cpu_adam``: ``deepspeed.ops.adam.DeepSpeedCPUAdam`` with zkit-offload installed; ``fused_adam``:
``FusedAdam`` over torch's fused Adam), so code that checks before it builds the optimizer uses it.
``load()`` (the compiled extension itself) raises :class:`FeatureNotProvided` for every op,
naming the op and what to use instead.
"""
from __future__ import annotations

import importlib.util
from typing import Any

from deepspeed.refused import FeatureNotProvided


class OpBuilder:
    """One DeepSpeed op. Subclasses set ``NAME`` and ``INSTEAD`` (what to use with zkit)."""

    NAME = "deepspeed_not_implemented"
    INSTEAD = "zkit has no equivalent of this op"

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME

    @property
    def BUILD_VAR(self) -> str:  # noqa: N802 - DeepSpeed's attribute name
        return f"DS_BUILD_{self.NAME.upper()}"

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.NAME}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        return False

    def load(self, verbose: bool = True) -> Any:
        raise FeatureNotProvided(f"DeepSpeed's compiled op {self.NAME!r} is not built by zkit: {self.INSTEAD}",
                                 name=self.absolute_name())

    def jit_load(self, verbose: bool = True) -> Any:
        return self.load(verbose)

    def builder(self) -> Any:
        return self.load(False)


def _has_offload() -> bool:
    return importlib.util.find_spec("zkit_offload") is not None


class CPUAdamBuilder(OpBuilder):
    NAME = "cpu_adam"
    INSTEAD = "use deepspeed.ops.adam.DeepSpeedCPUAdam (zkit-offload's CPU Adam) or an offload_optimizer config"

    def is_compatible(self, verbose: bool = False) -> bool:
        return _has_offload()


class FusedAdamBuilder(OpBuilder):
    NAME = "fused_adam"
    INSTEAD = "use deepspeed.ops.adam.FusedAdam (torch's fused Adam)"

    def is_compatible(self, verbose: bool = False) -> bool:
        return True


def _builder(class_name: str, name: str, instead: str) -> type[OpBuilder]:
    return type(class_name, (OpBuilder,), {"NAME": name, "INSTEAD": instead, "__module__": __name__,
                                           "__doc__": f"DeepSpeed's {name!r} op: not built by zkit."})


_OPTIMIZER = "set the optimizer in the config's \"optimizer\" section (zkit's Adam/AdamW/LAMB/SGD)"
CPUAdagradBuilder = _builder("CPUAdagradBuilder", "cpu_adagrad", "use torch.optim.Adagrad")
CPULionBuilder = _builder("CPULionBuilder", "cpu_lion", _OPTIMIZER)
FusedLambBuilder = _builder("FusedLambBuilder", "fused_lamb", "use the config's optimizer type \"Lamb\" (zkit's LAMB)")
FusedLionBuilder = _builder("FusedLionBuilder", "fused_lion", _OPTIMIZER)
AsyncIOBuilder = _builder("AsyncIOBuilder", "async_io", "zkit-offload's NVMe offload does its own I/O "
                                                        "(offload_optimizer / offload_param device \"nvme\")")
GDSBuilder = _builder("GDSBuilder", "gds", "zkit-offload's NVMe offload does its own I/O")
PinMemoryBuilder = _builder("PinMemoryBuilder", "pin_memory", "use torch.Tensor.pin_memory()")
SparseAttnBuilder = _builder("SparseAttnBuilder", "sparse_attn", "use deepspeed.ops.sparse_attention (zkit-sparse)")
TransformerBuilder = _builder("TransformerBuilder", "transformer", "use torch's transformer layers")
StochasticTransformerBuilder = _builder("StochasticTransformerBuilder", "stochastic_transformer",
                                        "use torch's transformer layers")
InferenceBuilder = _builder("InferenceBuilder", "transformer_inference", "DeepSpeed-Inference is not part of zkit")
QuantizerBuilder = _builder("QuantizerBuilder", "quantizer", "use torch.ao.quantization")
FPQuantizerBuilder = _builder("FPQuantizerBuilder", "fp_quantizer", "use torch.ao.quantization")
RandomLTDBuilder = _builder("RandomLTDBuilder", "random_ltd", "zkit has no random-LTD")
UtilsBuilder = _builder("UtilsBuilder", "utils", "use torch._utils._flatten_dense_tensors")
DeepCompileBuilder = _builder("DeepCompileBuilder", "dc", "use torch.compile")
EvoformerAttnBuilder = _builder("EvoformerAttnBuilder", "evoformer_attn", "use scaled_dot_product_attention")
NotImplementedBuilder = OpBuilder

#: every op by name, as DeepSpeed's ``op_builder.all_ops.ALL_OPS``
ALL_OPS: dict[str, OpBuilder] = {
    b.NAME: b() for b in (CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder, FusedAdamBuilder, FusedLambBuilder,
                          FusedLionBuilder, AsyncIOBuilder, GDSBuilder, PinMemoryBuilder, SparseAttnBuilder,
                          TransformerBuilder, StochasticTransformerBuilder, InferenceBuilder, QuantizerBuilder,
                          FPQuantizerBuilder, RandomLTDBuilder, UtilsBuilder, DeepCompileBuilder,
                          EvoformerAttnBuilder)
}


def compatible_ops() -> dict[str, bool]:
    """``{op name: is_compatible()}`` for every op, ``deepspeed_not_implemented`` False."""
    out = {name: b.is_compatible() for name, b in ALL_OPS.items()}
    out["deepspeed_not_implemented"] = False
    return out


__all__ = ["ALL_OPS", "OpBuilder", "compatible_ops", *[type(b).__name__ for b in ALL_OPS.values()],
           "NotImplementedBuilder"]
