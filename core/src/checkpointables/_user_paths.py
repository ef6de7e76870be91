"""A save's names checked against the filesystem's limit on one name (255 bytes on
most) before anything is created, allowing for the suffix of the save's
temporary directory.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable

from etils import epath

from checkpointables import errors, storage

__all__ = ["check_name_lengths"]

# What a save's temporary directory adds to the checkpoint's name
# (".checkpointables-tmp-<ns>-<pid>-<10 hex host tag><4 hex>", 63 bytes with a 7-digit
# pid), with a byte to spare.
TEMPORARY_SUFFIX_BYTES = 64
_DEFAULT_NAME_MAX = 255


def _name_max(path: str) -> int:
    """The longest name the filesystem holding ``path`` (or its nearest existing parent) allows."""
    directory = os.path.abspath(path)
    while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)
    try:
        return int(os.pathconf(directory, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return _DEFAULT_NAME_MAX


def _too_long(what: str, name: str, limit: int) -> errors.NameTooLongError:
    shown = name if len(name) <= 40 else name[:40] + "..."
    return errors.NameTooLongError(
        errno.ENAMETOOLONG,
        f"The {what} {shown!r} is {len(name.encode())} bytes long; this filesystem allows names "
        f"of at most {limit} bytes here. Choose a shorter name; nothing was written",
    )


def check_name_lengths(path: epath.Path, names: Iterable[str]) -> None:
    """Raises before a save writes anything if ``path``'s or a checkpointable's name is too
    long for the filesystem (the checkpoint's name also carries its temporary suffix).

    Raises:
      cp.errors.NameTooLongError: a name is too long.
    """
    text = os.fspath(path)
    if not storage.is_local(text):
        return
    limit = _name_max(os.path.dirname(os.path.abspath(text)))
    final = os.path.basename(text.rstrip(os.sep))
    if len(final.encode()) + TEMPORARY_SUFFIX_BYTES > limit:
        raise _too_long("checkpoint directory", final, limit - TEMPORARY_SUFFIX_BYTES)
    for name in names:
        if len(name.encode()) > limit:
            raise _too_long("checkpointable name", name, limit)
