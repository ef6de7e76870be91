"""Errors raised by the training ``Checkpointer``.

Each keeps the builtin meaning, so ``except FileExistsError``, ``except
FileNotFoundError`` and ``except RuntimeError`` keep working, and each is a
``cp.errors.CheckpointError``.
"""

from __future__ import annotations

from checkpointables.errors import CheckpointError

__all__ = ["CheckpointerClosedError", "StepAlreadyExistsError", "StepNotFoundError"]


class StepAlreadyExistsError(CheckpointError, FileExistsError):
    """A save names a step that already has a checkpoint (pass ``overwrite=True`` to replace it)."""


class StepNotFoundError(CheckpointError, FileNotFoundError):
    """A load or metadata read names a step that has no committed checkpoint.

    The message lists the steps that do exist.
    """


class CheckpointerClosedError(CheckpointError, RuntimeError):
    """A save was asked of a ``Checkpointer`` after ``close()`` (or its ``with`` block): its
    background work has stopped. Create a new ``Checkpointer`` on the same root."""
