"""``deepspeed.runtime.fp16``: the names of DeepSpeed's FP16 optimizer wrappers, for imports and
``isinstance`` checks; building one is refused (set ``fp16.enabled`` or ``bf16.enabled`` in the
config: the engine keeps fp32 masters and scales the loss itself)."""
