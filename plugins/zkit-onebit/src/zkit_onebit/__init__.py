"""1-bit compressed communication and 1-bit Adam for zkit.

* :class:`OneBitCommunicator` - 1-bit error-feedback all-reduce/reduce-scatter (``"onebit"``).
* :class:`OneBitAdam` - 1-bit Adam (``"optimizer": {"type": "OneBitAdam"}``), ZeRO stages 0-2.
* :class:`ZeroOneAdam` - 0/1 Adam (``"optimizer": {"type": "ZeroOneAdam"}``), ZeRO stage 0.
* :func:`compressed_all_reduce`, :func:`pack_signs`... - the building blocks.
"""
__version__ = "0.1.0"

from zkit_onebit.adam import OneBitAdam  # noqa: E402
from zkit_onebit.collectives import compressed_all_reduce, compressed_reduce_scatter  # noqa: E402
from zkit_onebit.communicator import OneBitCommunicator  # noqa: E402
from zkit_onebit.compression import ChunkLayout, ErrorFeedback  # noqa: E402
from zkit_onebit.packing import pack_bits, pack_signs, unpack_bits, unpack_signs  # noqa: E402
from zkit_onebit.zeroone_adam import ZeroOneAdam  # noqa: E402

__all__ = [
    "ChunkLayout",
    "ErrorFeedback",
    "OneBitAdam",
    "OneBitCommunicator",
    "ZeroOneAdam",
    "compressed_all_reduce",
    "compressed_reduce_scatter",
    "pack_bits",
    "pack_signs",
    "unpack_bits",
    "unpack_signs",
]
