"""Errors raised by the training ``Checkpointer``.

Both keep the builtin meaning, so ``except FileExistsError`` and ``except
FileNotFoundError`` keep working, and both are ``cp.errors.CheckpointError``s.
"""

from __future__ import annotations

from checkpointables.errors import CheckpointError

__all__ = ["StepAlreadyExistsError", "StepNotFoundError"]


class StepAlreadyExistsError(CheckpointError, FileExistsError):
    """A save names a step that already has a checkpoint (pass ``overwrite=True`` to replace it)."""


class StepNotFoundError(CheckpointError, FileNotFoundError):
    """A load or metadata read names a step that has no committed checkpoint.

    The message lists the steps that do exist.
    """
