"""Checkpoint errors name the file and what does not match."""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, truncated, or does not match the model being loaded."""
