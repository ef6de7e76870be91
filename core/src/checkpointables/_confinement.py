"""Keeping a load inside its checkpoint: no symbolic link may lead out of it.

TensorStore and the handlers open files by their paths inside the checkpoint
directory, following symbolic links. So before anything is read, the
checkpoint is walked once (``os.scandir``: the entry types come with the
listing, no ``stat`` per file) and every symbolic link in it must resolve to
a path inside it; links to elsewhere are refused, so no byte outside the
checkpoint is read or quoted in an error. (Recorded checkpointable names are
checked where ``_CHECKPOINT_METADATA`` is parsed.)
"""

from __future__ import annotations

import os

from etils import epath

from checkpointables import errors, storage

__all__ = ["check_contained"]


def _inside(target: str, root: str) -> bool:
    return target == root or target.startswith(root.rstrip(os.sep) + os.sep)


def check_contained(checkpoint: epath.PathLike) -> None:
    """Raises unless every symbolic link under ``checkpoint`` resolves inside it.

    Remote checkpoints (``gs://``, ``s3://``) have no symbolic links.

    Raises:
      cp.errors.OutsideCheckpointError: a link leads outside the checkpoint.
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
                    if not _inside(os.path.realpath(entry.path), real_root):
                        raise errors.OutsideCheckpointError(
                            f"{entry.path} is a symbolic link to {os.readlink(entry.path)!r}, "
                            f"outside the checkpoint {root}; the checkpoint is refused, and "
                            f"nothing outside it is read. Replace the link by the files it "
                            f"points to (e.g. `cp -rL`), or remove it."
                        )
                elif entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
