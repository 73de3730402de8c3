"""Which of DeepSpeed 0.19.8's public names the drop-in answers, and how: the coverage inventory.

The names are those real code imports or reaches, found by ``tools/scan_deepspeed_names.py`` in
DeepSpeed's own CPU-capable unit tests, DeepSpeedExamples (DeepSpeed-Chat and the training folder
also on their own), and the DeepSpeed integrations of transformers, Accelerate and Lightning
(``Entry.sources``). Each is either *provided*, with
DeepSpeed's behaviour, or *refused*: resolving it raises
:class:`deepspeed.refused.FeatureNotProvided`, whose message names the feature and
what to use instead (``deepspeed.refused`` holds the messages). A name outside the
inventory keeps Python's usual errors, so feature probes of unknown names answer "absent".

``python -m zkit_deepspeed.coverage_page > docs/deepspeed-coverage.md`` writes the page;
``plugins/zkit-deepspeed/tests/test_coverage.py`` checks the page and every entry. The candidates
came from (the sources stay outside this repository)::

    python tools/scan_deepspeed_names.py transformers=<site-packages>/transformers \
        accelerate=<site-packages>/accelerate lightning=<lightning 2.6 wheel, unpacked>/lightning \
        examples=git:<DeepSpeedExamples clone> ds-tests=<DeepSpeed tests/unit>/<each CPU-capable file> \
        ds-chat=git:<DeepSpeedExamples clone>:applications/DeepSpeed-Chat \
        training=git:<DeepSpeedExamples clone>:training
"""
from __future__ import annotations

import importlib
from typing import Any

from zkit_deepspeed.coverage_entries import ENTRIES  # noqa: F401 - the data, in its own file
from zkit_deepspeed.coverage_model import Entry, Status

__all__ = ["ENTRIES", "EXCLUDED", "Entry", "SOURCES", "Status", "resolve"]

#: where a name was found (``Entry.sources``)
SOURCES = {
    "transformers": "transformers' `integrations/deepspeed.py` and models (installed package)",
    "accelerate": "Accelerate's `utils/deepspeed.py`, `accelerator.py` and the rest of the package",
    "lightning": "Lightning 2.6's DeepSpeed strategies, precision plugins and utilities",
    "examples": "DeepSpeedExamples (training, inference and compression examples)",
    "ds-chat": "DeepSpeedExamples' `applications/DeepSpeed-Chat` (its training steps 1-3, the `dschat` library, "
               "chat and inference); the step-1 script runs unmodified under both (`contrib/deepspeed_chat_sft.py`)",
    "training": "DeepSpeedExamples' `training/` folder, each of its training examples",
    "ds-tests": "DeepSpeed's own unit tests: the files of the CPU survey (those that pass on a CPU are "
                "`zkit_deepspeed.unit_tests.CPU_CAPABLE_FILES`) and their helpers",
}


def resolve(name: str) -> Any:
    """The object ``name`` stands for under ``import deepspeed``: the longest importable module
    prefix, then attributes. Raises what the import or the attribute raises."""
    parts = name.split(".")
    module = importlib.import_module(parts[0])
    depth = 1
    for i in range(len(parts), 1, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as exc:
            if exc.name is not None and ".".join(parts[:i]).startswith(exc.name):
                continue  # not a module (an attribute, or absent): try a shorter prefix
            raise
        depth = i
        break
    obj = module
    for attr in parts[depth:]:
        obj = getattr(obj, attr)
    return obj


#: candidates the scanner finds that are not DeepSpeed names code relies on, with the reason
EXCLUDED: dict[str, str] = {
    "deepspeed.png": "a file name in a string, not a module",
    "deepspeed.runtime.lr_schedules.append": "a list's method reached through a module alias",
    "deepspeed.utils.is_initialized": "not in DeepSpeed 0.19.8 (transformers' ESMFold calls it on an old API)",
    "deepspeed.runtime.engine.DeepSpeedEngine.deepspeed_io": "a method of the engine, not a module name: the "
                                                             "engine's methods are in docs/engine.md",
}
