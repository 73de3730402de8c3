"""``deepspeed.utils.numa``: ``parse_range_list``, the launcher's core-list syntax (``"0,2-4,6"`` ->
``[0, 2, 3, 4, 6]``; ranges ascending, not overlapping). zkit's launcher binds no cores (bind with
numactl around ``zkit run``); the rest of DeepSpeed's module is refused."""
from __future__ import annotations

from deepspeed.refused import module_getattr

__all__ = ["parse_range", "parse_range_list"]


def parse_range(text: str) -> range:
    """``"3"`` -> ``range(3, 4)``; ``"2-5"`` -> ``range(2, 6)`` (both ends included)."""
    if text.strip().lstrip("-").isdigit():
        value = int(text)
        return range(value, value + 1)
    parts = text.split("-")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"Bad range: '{text}', range must be either a number or two number separated by dash")
    start, end = int(parts[0]), int(parts[1])
    if start > end:
        raise ValueError(f"Bad range: '{text}', range end must larger than or equal to start")
    return range(start, end + 1)


def parse_range_list(text: str) -> list[int]:
    """The numbers of a comma-separated list of numbers and ranges, in ascending, disjoint order."""
    numbers: list[int] = []
    for item in text.split(","):
        block = parse_range(item)
        if numbers and block[0] <= numbers[-1]:
            raise ValueError(f"Bad range: '{text}', sub ranges must not overlap with each other and should be in "
                             f"ascend order")
        numbers.extend(block)
    return numbers


__getattr__ = module_getattr(__name__)
