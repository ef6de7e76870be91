"""Turning the operating system's errors of a save into the library's documented ones.

A full disk (``ENOSPC``, or a quota: ``EDQUOT``) becomes
``cp.errors.DiskFullError`` and a name too long for the filesystem
(``ENAMETOOLONG``) ``cp.errors.NameTooLongError``; both are still
``OSError``s with the same ``errno``. Other ``OSError``s keep their builtin
class (``PermissionError`` stays a ``PermissionError``).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator

from checkpointables import errors

__all__ = ["translated", "translate"]

_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def translate(error: OSError, what: str) -> OSError:
    """The library error for ``error`` raised while doing ``what`` (``error`` if none fits)."""
    if isinstance(error, errors.CheckpointError):
        return error
    where = f" ({error.filename})" if error.filename else ""
    if error.errno in _DISK_FULL:
        return errors.DiskFullError(
            error.errno,
            f"No space left on the device{where} while {what}. Nothing was committed and the "
            f"save's temporary files were removed: free some space (for example by keeping "
            f"fewer checkpoints) and save again",
        )
    if error.errno == errno.ENAMETOOLONG:
        return errors.NameTooLongError(
            error.errno,
            f"A path is too long for the filesystem{where} while {what}. Choose a shorter "
            f"checkpoint path or checkpointable name",
        )
    return error


@contextlib.contextmanager
def translated(what: str) -> Iterator[None]:
    """Re-raises ``OSError``s of the ``with`` body as their library errors (see ``translate``).

    Example::

        with translated(f"saving {path}"):
            path.parent.mkdir(parents=True, exist_ok=True)
    """
    try:
        yield
    except OSError as e:
        replacement = translate(e, what)
        if replacement is e:
            raise
        raise replacement from e
