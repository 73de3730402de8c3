"""Build the C++ ops that the real DeepSpeed compiles on first use on the CPU, once, at set-up.

    DS_ACCELERATOR=cpu .venv-peers/bin/python tests/deepspeed_peer_ops.py

DeepSpeed builds its CPU Adam, its CPU FusedAdam and its shared-memory communication ops with
torch's JIT extension loader the first time a run needs them (about 100 s together on 2 cores),
into ``TORCH_EXTENSIONS_DIR``: here, unless set, ``torch_extensions`` in the peer environment, where
the suite's ``conftest.py`` points the peer runs (torch's default, ``~/.cache/torch_extensions``, is
shared by every checkout of the user, whose builds would replace each other). ``make peers`` runs this
script so that the tests comparing against DeepSpeed do not pay for the build inside the suite; a
later load finds the built library and takes a fraction of a second. A build that fails ends
set-up with DeepSpeed's own error.
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

#: DeepSpeed's builders that its CPU accelerator uses in the peer runs
BUILDERS = ("CPUAdamBuilder", "FusedAdamBuilder", "ShareMemCommBuilder")


def main() -> None:
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    for name in BUILDERS:
        start = time.perf_counter()
        builder = accelerator.create_op_builder(name)
        if builder is None:
            print(f"{name}: not used by DeepSpeed's {accelerator.device_name()} accelerator")
            continue
        builder.load(verbose=False)
        print(f"{name}: ready ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
