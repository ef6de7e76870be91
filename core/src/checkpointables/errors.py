"""Errors raised by checkpointables.

Every library error derives from :class:`CheckpointError`. Where a builtin
exception already carries the meaning (a missing path, an existing path, a bad
argument) the error also derives from that builtin, so ``except
FileNotFoundError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "NotACheckpointError",
    "MetadataError",
    "MissingHandlerError",
    "NoHandlerForObjectError",
    "IntegrityError",
    "PluginError",
    "TreeMismatchError",
    "UnsupportedPathError",
]


class CheckpointError(Exception):
    """Base class of every error checkpointables raises on purpose."""


class NotACheckpointError(CheckpointError, ValueError):
    """A directory exists but is not a finished checkpoint.

    Raised for empty directories, temporary directories left by an unfinished
    save, and directories missing ``_CHECKPOINT_METADATA``.
    """


class MetadataError(CheckpointError, ValueError):
    """A metadata file is unreadable or malformed; the message names the file."""


class MissingHandlerError(CheckpointError, LookupError):
    """No registered handler can load what a checkpoint recorded.

    The message names the recorded typestr and, when the typestr belongs to a
    known plugin, the distribution to ``pip install``.
    """


class NoHandlerForObjectError(CheckpointError, TypeError):
    """No registered handler accepts an object given for saving.

    The message names the checkpointable, its type and the handlers tried.
    """


class IntegrityError(CheckpointError):
    """Stored data failed its checksum or is missing; the message names the leaf."""


class PluginError(CheckpointError, RuntimeError):
    """A plugin misbehaved while registering its handlers."""


class TreeMismatchError(CheckpointError, ValueError):
    """A tree does not match the tree it was expected to match.

    The message lists the key paths that are missing, extra or different.
    """


class UnsupportedPathError(CheckpointError, ValueError):
    """A path names a storage scheme (``memory://``, ``ftp://``...) that nothing here reaches."""
