"""An iterator that starts its loader over when it runs out (for step-counted training loops)."""
from __future__ import annotations

from typing import Any, Iterable, Iterator


class RepeatingLoader:
    """Iterate ``loader`` forever: at its end a new pass begins (as DeepSpeed's: the sampler's
    epoch is left to the caller)."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter: Iterator[Any] = iter(loader)

    def __iter__(self) -> "RepeatingLoader":
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
        try:
            return next(self.data_iter)
        except StopIteration:  # a fresh pass gave nothing: repeating it never would
            raise ValueError(f"RepeatingLoader: the loader ({type(self.loader).__name__}) gives no batch, an empty "
                             f"dataset: there is nothing to repeat") from None
