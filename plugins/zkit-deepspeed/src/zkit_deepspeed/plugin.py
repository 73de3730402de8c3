"""zkit hooks of the deepspeed drop-in: a ``zkit report`` line, the ``"deepspeed"`` checkpoint
format (DeepSpeed's checkpoints load into zkit and consolidate), and the sequence-parallel group of
an engine ``deepspeed.initialize(mpu=parallel_state_sp)`` builds (:mod:`zkit_deepspeed.sequence_mpu`)."""
from __future__ import annotations

import zkit
from zkit_deepspeed.active import active_deepspeed
from zkit_deepspeed.checkpoint.format import RECORD
from zkit_deepspeed.sequence_mpu import sequence_group


@zkit.hookimpl
def zkit_report():
    yield "deepspeed", active_deepspeed().describe()


@zkit.hookimpl
def zkit_register_checkpoint_formats():
    yield RECORD


@zkit.hookimpl(tryfirst=True)
def zkit_sequence_parallel(module, size):
    # only while deepspeed.initialize builds an engine from DeepSpeed's groups; else zkit-sequence answers
    return sequence_group(module, size)
