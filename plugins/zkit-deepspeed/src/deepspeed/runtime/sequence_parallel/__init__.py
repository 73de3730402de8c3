"""``deepspeed.runtime.sequence_parallel``: ALST's data-loader adapter (``ulysses_sp``)."""
