"""DeepSpeed checkpoints, read by zkit: a DeepSpeed run continues in zkit at any world size and
ZeRO stage (``engine.load_checkpoint`` recognises the directory) and ``zkit consolidate`` writes
its weights as one state dict, streaming.

- :mod:`~zkit.checkpoint.deepspeed.layout`: recognising the directory, naming its files
- :mod:`~zkit.checkpoint.deepspeed.unpickler`: reading them without running their pickles
- :mod:`~zkit.checkpoint.deepspeed.stage12` and :mod:`~zkit.checkpoint.deepspeed.stage3`: where
  each parameter's elements sit in DeepSpeed's flat partitions
- :mod:`~zkit.checkpoint.deepspeed.checkpoint`: one tag as zkit's pieces and index
- :mod:`~zkit.checkpoint.deepspeed.load`: the engine-side load
"""
