"""``deepspeed.runtime.sequence_parallel``: Ulysses for Hugging Face models and ALST's data-loader adapter
(``ulysses_sp``), DeepSpeed's sequence-parallel groups (``parallel_state_sp``)."""
