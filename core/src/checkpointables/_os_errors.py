"""Turning the operating system's errors of a save into the library's documented ones.

A full disk (``ENOSPC``, or a quota: ``EDQUOT``) becomes
``cp.errors.DiskFullError`` and a name too long for the filesystem
(``ENAMETOOLONG``) ``cp.errors.NameTooLongError``, a file over the
filesystem's or the process's size limit (``EFBIG``)
``cp.errors.FileTooLargeError``; all are still ``OSError``s with the same
``errno``. Other ``OSError``s keep their builtin class (``PermissionError``
stays a ``PermissionError``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from checkpointables import errors

__all__ = ["translated"]


@contextlib.contextmanager
def translated(what: str) -> Iterator[None]:
    """Re-raises ``OSError``s of the ``with`` body as their library errors (see
    ``cp.errors.from_os_error``).

    Example::

        with translated(f"saving {path}"):
            path.parent.mkdir(parents=True, exist_ok=True)
    """
    try:
        yield
    except OSError as e:
        replacement = errors.from_os_error(e, what)
        if replacement is e:
            raise
        raise replacement from e
