"""``deepspeed.sequence``: DeepSpeed-Ulysses' ``layer.DistributedAttention``, on zkit-sequence."""
