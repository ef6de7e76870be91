"""The ``checkpointables demo`` command (filled in with the training Checkpointer)."""

from __future__ import annotations


def main(directory: str | None = None, *, steps: int = 300) -> int:
    """Trains a small model with checkpoints; returns the exit status."""
    raise NotImplementedError("the demo is not written yet")
