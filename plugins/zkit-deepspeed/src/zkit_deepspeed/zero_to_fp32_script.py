#!/usr/bin/env python
"""Write the weights of the ZeRO checkpoint in this folder as one fp32 state dict:

    python zero_to_fp32.py <this folder> <output folder> [--safe_serialization] [-t TAG]

The drop-in (``deepspeed``, zkit) copies this script into every folder ``save_checkpoint`` writes,
as DeepSpeed copies its own; it runs :func:`deepspeed.utils.zero_to_fp32.main`, which reads zkit's
checkpoints and DeepSpeed's alike. It needs the drop-in installed."""
import sys

from deepspeed.utils.zero_to_fp32 import main

if __name__ == "__main__":
    sys.exit(main())
