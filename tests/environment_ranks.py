"""Rank function of tests/test_testing.py's environment checks: it imports nothing heavy, so that a
spawned rank starts as fast as it can."""
import os


def getenvs(*names: str) -> list[str | None]:
    """The values of ``names`` in this rank's environment (``None``: not set)."""
    return [os.getenv(name) for name in names]
