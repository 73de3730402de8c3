"""``deepspeed.runtime``."""
