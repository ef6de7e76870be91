"""Keeping a load inside its checkpoint, and off anything that is not a file or directory.

TensorStore and the handlers open files by their paths inside the checkpoint
directory, following symbolic links. So before anything is read, the
checkpoint is walked once (``os.scandir``: the entry types come with the
listing, no ``stat`` per file) and every symbolic link in it must resolve to
a path inside it; links to elsewhere are refused, so no byte outside the
checkpoint is read or quoted in an error. (Recorded checkpointable names are
checked where ``_CHECKPOINT_METADATA`` is parsed.)

The same walk refuses named pipes, sockets and devices (and links to them):
opening a pipe blocks until something writes to it, and TensorStore, which
opens the array files itself, would wait forever. The library's own reads
check each file again as they open it (``cp.storage.open_regular_file``).
"""

from __future__ import annotations

import errno
import os
import stat

from etils import epath

from checkpointables import errors, storage

__all__ = ["check_contained"]


def _inside(target: str, root: str) -> bool:
    return target == root or target.startswith(root.rstrip(os.sep) + os.sep)


def check_contained(checkpoint: epath.PathLike) -> None:
    """Raises unless every symbolic link under ``checkpoint`` resolves inside it and every
    entry is a regular file or a directory (or a link to one).

    Remote checkpoints (``gs://``, ``s3://``) have no symbolic links, pipes or devices.

    Raises:
      cp.errors.OutsideCheckpointError: a link leads outside the checkpoint.
      cp.errors.IntegrityError: an entry is a named pipe, a socket or a device.
    """
    root = os.fspath(checkpoint)
    if not storage.is_local(root):
        return
    real_root: str | None = None
    pending = [root]
    while pending:
        directory = pending.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.is_symlink():
                    real_root = real_root or os.path.realpath(root)
                    _check_link(entry.path, root, real_root)
                elif entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
                elif not entry.is_file(follow_symlinks=False):
                    raise storage.not_a_regular_file(entry.path, entry.stat().st_mode)


def _check_link(path: str, root: str, real_root: str) -> None:
    if not _inside(os.path.realpath(path), real_root):
        raise errors.OutsideCheckpointError(
            f"{path} is a symbolic link to {os.readlink(path)!r}, outside the checkpoint "
            f"{root}; the checkpoint is refused, and nothing outside it is read. Replace the "
            f"link by the files it points to (e.g. `cp -rL`), or remove it."
        )
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:  # Nothing could be read through it: say which link.
            raise storage.link_loop(path) from None
        return  # Dangling: reading it says the file is missing.
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise storage.not_a_regular_file(path, mode)
