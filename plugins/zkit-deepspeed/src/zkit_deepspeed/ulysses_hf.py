"""DeepSpeed's ``UlyssesSPAttentionHF`` (``deepspeed.runtime.sequence_parallel.ulysses_sp``): Ulysses
sequence parallelism inside a Hugging Face Transformers model, over zkit-sequence's all-to-alls.

``register_with_transformers`` puts a :class:`UlyssesSPAttentionHF` in place of the model's
attention function in ``transformers``' ``ALL_ATTENTION_FUNCTIONS`` (under the same key, so the
model's own branches on ``_attn_implementation`` still run) and returns the sequence-parallel
groups (:mod:`deepspeed.runtime.sequence_parallel.parallel_state_sp`), which Accelerate passes to
``deepspeed.initialize(mpu=...)``. Each call then takes this rank's slice of the sequence with every
head (``[batch, heads, seq / P, head_dim]``), gives the wrapped attention ``heads / P`` heads of the
whole sequence (``zkit_sequence.exchange.heads_to_sequence``) with the whole sequence's position ids,
and returns its output as this rank's slice (``[batch, seq / P, hidden]``). As DeepSpeed: the 4-D
attention mask Transformers built for the slice is dropped (the wrapped attention is causal by
itself); fewer key-value heads than ranks are repeated to one per rank; heads not divisible by the
ranks are refused. What DeepSpeed does and zkit does not (``flex_attention``, whose block mask
DeepSpeed rebuilds) is refused with a message.
"""
from __future__ import annotations

import importlib.metadata
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from deepspeed.refused import FeatureNotProvided
from zkit_deepspeed.optional import import_plugin

_NAME = "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF"
_TRANSFORMERS_MIN = (4, 51, 3)
#: attention implementations DeepSpeed refuses: they build the whole [seq, seq] mask
_EAGER = ("eager", "paged|eager")
_FLEX = "flex_attention"


class UlyssesSPAttentionHF(torch.nn.Module):
    """A Hugging Face attention function (``attn(module, query, key, value, attention_mask, ...)``)
    run sequence-parallel over ``process_group``; DeepSpeed's signature. See the module's text."""

    def __init__(self, attn: Callable[..., Any], batch_size: int, attn_head_count: int, attn_head_size: int,
                 kv_head_count: int, num_hidden_layers: int, process_group: Any, seq_length_is_variable: bool = False,
                 local_seq_length: int | None = None, global_seq_length: int | None = None,
                 disable_in_eval: bool = False) -> None:
        super().__init__()
        from zkit.torch_distributed import DeferredCommunicator

        self.exchange = import_plugin("zkit_sequence.exchange", _NAME)
        self.attn = attn
        self.process_group = process_group
        #: the group's communicator: the installed plugins' choice (its all_to_all bytes are counted)
        self.comm = DeferredCommunicator(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.sp_rank = dist.get_rank(process_group)
        self.batch_size = batch_size
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.disable_in_eval = disable_in_eval
        self.attn_head_size, self.attn_head_count = attn_head_size, attn_head_count
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.skip_all_but_last_attention_debug_mode = False
        self.rotating_layer_counter = 0
        self.core_attn_implementation: str | None = None  # set by register_with_transformers
        _require_transformers()
        if attn_head_count % self.world_size:
            raise ValueError(f"Attention head count {attn_head_count} is not divisible by SP size {self.world_size}")
        if kv_head_count % self.world_size and self.world_size % kv_head_count:
            raise ValueError(f"KV attention head count {kv_head_count} is not divisible by SP size {self.world_size} "
                             f"or vice versa")
        self.local_q_head_count = attn_head_count // self.world_size
        # 4 key-value heads and 8 ranks: each is repeated twice so that every rank gets one
        self.kv_replication_factor = self.world_size // kv_head_count
        self.local_kv_head_count = 1 if self.kv_replication_factor > 1 else kv_head_count // self.world_size
        if not seq_length_is_variable and (local_seq_length is None or global_seq_length is None):
            raise ValueError("UlyssesSPAttentionHF: with seq_length_is_variable=False give local_seq_length and "
                             "global_seq_length")

    def _check_shapes(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        local = query.shape[2] if self.seq_length_is_variable else self.local_seq_length
        want_q = (self.batch_size, self.attn_head_count, local, self.attn_head_size)
        want_kv = (self.batch_size, self.global_kv_head_count, local, self.attn_head_size)
        if tuple(query.shape) != want_q or tuple(key.shape) != want_kv or tuple(value.shape) != want_kv:
            raise ValueError(f"[{dist.get_rank()}]: UlyssesSPAttentionHF expects query {want_q} and key/value "
                             f"{want_kv} ([batch, heads, seq / {self.world_size}, head_size]), got query "
                             f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")

    def forward(self, module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        """``query``, ``key``, ``value``: ``[batch, heads, seq / P, head_size]``; returns ``(output
        [batch, seq / P, heads * head_size], attention weights)``."""
        if not module.training and self.disable_in_eval:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        self._check_shapes(query, key, value)
        if self.seq_length_is_variable:
            self.local_seq_length = query.shape[2]
            self.global_seq_length = self.local_seq_length * self.world_size
        if "position_ids" not in kwargs or kwargs["position_ids"] is None:
            raise ValueError("Ulysses SP requires position_ids in every forward() call so that after all_gather "
                             "causal masking works correctly: for non-packed sequences position_ids = "
                             "torch.arange(seq_len) per sample (UlyssesSPDataLoaderAdapter includes them)")
        kwargs["position_ids"] = self.exchange.gather_sequence(kwargs["position_ids"], self.comm)
        if self.kv_replication_factor > 1:  # MQA and some GQA: one key-value head per rank
            key = key.repeat_interleave(self.kv_replication_factor, dim=1)
            value = value.repeat_interleave(self.kv_replication_factor, dim=1)
        q, k, v = (self.exchange.heads_to_sequence(t.contiguous(), self.comm) for t in (query, key, value))
        if self.skip_all_but_last_attention_debug_mode:
            # DeepSpeed's debugging mode: every layer but the last skips attention (garbage by design)
            self.rotating_layer_counter = (self.rotating_layer_counter + 1) % self.num_hidden_layers
            if self.rotating_layer_counter:
                return self._back(q.transpose(1, 2)), None
        # the wrapped attention repeats the local key-value heads to the local query heads
        groups = getattr(module, "num_key_value_groups", None)
        if groups is not None:
            module.num_key_value_groups = q.shape[1] // k.shape[1]
        try:
            context, weights = self.attn(module, q, k, v, attention_mask, *args, **kwargs)  # [b, s, h/P, d]
        finally:
            if groups is not None:
                module.num_key_value_groups = groups
        return self._back(context), weights

    def _back(self, context: Tensor) -> Tensor:
        """``[batch, seq, heads / P, head_size]`` to this rank's ``[batch, seq / P, heads * head_size]``."""
        out = self.exchange.sequence_to_heads(context.transpose(1, 2).contiguous(), self.comm)  # [b, h, s/P, d]
        return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int, seq_length: int | None = None,
                                   seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                                   max_length: int | None = None) -> Any:
        """Put Ulysses around the model's attention implementation ``core_attn_implementation``
        in ``transformers``' ``ALL_ATTENTION_FUNCTIONS`` and return the sequence-parallel groups
        (the ``mpu`` for ``deepspeed.initialize``); ``None`` when ``sequence_parallel_size`` is 1.
        ``model_name_or_path``: the model (or its config's name or path)."""
        if sequence_parallel_size == 1:
            return None
        if max_length is not None:
            from deepspeed.utils import logger

            logger.warning("The 'max_length` argument is deprecated and will be eventually removed, please use "
                           "`seq_length` instead")
            seq_length = max_length if seq_length is None else seq_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("Either `seq_length_is_variable` needs to be `True` or `seq_length` needs to be set to an "
                             "integer value of the fixed batch size length.")
        from transformers import AutoConfig, PreTrainedModel
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu

        loaded = hasattr(model_name_or_path, "config") or isinstance(model_name_or_path, PreTrainedModel)
        config = model_name_or_path.config if loaded else AutoConfig.from_pretrained(model_name_or_path)
        if loaded:
            resolved = getattr(config, "_attn_implementation", None)
            if resolved is not None and resolved != core_attn_implementation:
                raise ValueError(f"core_attn_implementation='{core_attn_implementation}' does not match model config "
                                 f"attn_implementation='{resolved}'. Set both to the same value so sequence-parallel "
                                 f"wrapper can intercept the active attention path.")
        if core_attn_implementation in _EAGER:
            raise ValueError(f"{core_attn_implementation} attn_implementation isn't currently supported by Ulysses "
                             f"sequence parallelism because it requires a 4D attention_mask (O(n²) memory). Use any "
                             f"flash attention variant or 'sdpa'.")
        if core_attn_implementation == _FLEX:
            raise FeatureNotProvided(f"{_NAME}.register_with_transformers(core_attn_implementation='flex_attention') "
                                     f"(DeepSpeed rebuilds a causal block mask for the gathered sequence) is not "
                                     f"provided by zkit: use 'sdpa' or a flash attention variant")
        if isinstance(core_attn_implementation, str) and "/" in core_attn_implementation:
            raise FeatureNotProvided(f"{_NAME}.register_with_transformers(core_attn_implementation="
                                     f"'{core_attn_implementation}') (a hub-hosted attention kernel) is not provided "
                                     f"by zkit: use 'sdpa' or a flash attention variant installed locally")
        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"{core_attn_implementation} is not a valid attn_implementation. The choices are "
                             f"{ALL_ATTENTION_FUNCTIONS.valid_keys()}")
        core = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
        mpu.initialize_sequence_parallel(sequence_parallel_size=sequence_parallel_size)
        text = config.get_text_config()
        variable = seq_length_is_variable
        uattn = cls(attn=core, batch_size=micro_batch_size, attn_head_count=text.num_attention_heads,
                    attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
                    kv_head_count=text.num_key_value_heads, num_hidden_layers=text.num_hidden_layers,
                    process_group=mpu.get_sequence_parallel_group(), seq_length_is_variable=variable,
                    local_seq_length=None if variable else seq_length // mpu.get_sequence_parallel_world_size(),
                    global_seq_length=None if variable else seq_length, disable_in_eval=disable_in_eval)
        uattn.core_attn_implementation = core_attn_implementation

        def uattn_wrapper(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                          *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
            # the mask Transformers built is the slice's: meaningless after the exchange, and
            # [seq, seq] in size; the wrapped attention masks causally by itself
            return uattn(module, query, key, value, None, *args, **kwargs)

        # under the core implementation's own key (not a new "ulysses" one): the model's branches
        # on config._attn_implementation keep working, as DeepSpeed's
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = uattn_wrapper
        return mpu


def _require_transformers() -> None:
    have = importlib.metadata.version("transformers")
    parts = tuple(int(p) for p in have.split(".")[:3] if p.isdigit())
    if parts < _TRANSFORMERS_MIN:
        raise ValueError(f"transformers>={'.'.join(map(str, _TRANSFORMERS_MIN))} is required, but you have "
                         f"transformers=={have}")
