"""``deepspeed.launcher``: DeepSpeed's launcher names (see :mod:`.runner`)."""
