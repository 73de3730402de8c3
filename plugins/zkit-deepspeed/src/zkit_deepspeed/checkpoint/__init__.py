"""DeepSpeed checkpoints, read by zkit: a DeepSpeed run continues in zkit at any world size and
ZeRO stage (``engine.load_checkpoint`` recognises the directory) and ``zkit consolidate`` writes
its weights as one state dict, streaming.

- :mod:`~zkit_deepspeed.checkpoint.layout`: recognising the directory, naming its files
- :mod:`~zkit_deepspeed.checkpoint.unpickler`: reading them without running their pickles
- :mod:`~zkit_deepspeed.checkpoint.stage12` and :mod:`~zkit_deepspeed.checkpoint.stage3`: where
  each parameter's elements sit in DeepSpeed's flat partitions
- :mod:`~zkit_deepspeed.checkpoint.checkpoint`: one tag as zkit's pieces and index
- :mod:`~zkit_deepspeed.checkpoint.load`: the engine-side load
- :mod:`~zkit_deepspeed.checkpoint.format`: the ``"deepspeed"`` checkpoint format record that
  :mod:`zkit_deepspeed.plugin` registers
"""
