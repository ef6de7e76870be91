"""A save never writes inside a finished checkpoint.

``cp.save_pytree("ck/pytree/sub", x)`` after ``ck`` was committed would add a
directory that ``ck``'s save did not write: ``ck``'s ``_CHECKSUMS`` and
``verify`` would then disagree with what it holds, and deleting either one
could be taken for deleting the other. Every save (``_saving.start``: the free
functions, their async forms, the Checkpointer) asks ``check_not_inside``
first; ``cp.partial`` asks ``refuse_inside`` about the user's path (its staged
saves, under that path's session, are then not looked at again).

What it costs, looking at the parents of the save's path for a finished checkpoint:

- local disks: every parent up to ``/`` (one ``stat`` each, microseconds), after
  resolving symbolic links, so a link into a checkpoint counts too;
- object stores: the nearest ``OBJECT_STORE_LEVELS`` parents only, one request
  each (the marker's HEAD; a second, the metadata's, only for a checkpoint
  found), issued together: one round trip per save, whatever the depth of the
  prefix. Those levels catch the mistakes that happen (saving into a
  checkpoint, into one of its checkpointable directories, or a folder in one);
  a deeper nesting on an object store is not looked for. A parent found to be
  no checkpoint is not asked again by this process (a Checkpointer's steps
  share their parents: its saves after the first add no request), until a save
  of this process to that very path starts or commits (it may commit a checkpoint there).
  A checkpoint another process commits at a parent of this process's later
  saves is therefore not seen.

A training root is not a checkpoint (it has no ``_CHECKPOINT_METADATA``, no
commit marker of its own), so the Checkpointer's steps pass; a Checkpointer
whose root lies in a finished checkpoint is refused like any save.
"""

from __future__ import annotations

import os
import threading

from etils import epath

from checkpointables import errors, layout, multihost, storage
from checkpointables._asyncio import concurrently

__all__ = [
    "OBJECT_STORE_LEVELS",
    "enclosing_checkpoint",
    "forget",
    "refuse_inside",
    "check_not_inside",
]

# How many parents of an object-store save are looked at (see the module's docstring).
OBJECT_STORE_LEVELS = 4
# Object-store parents found to be no checkpoint, not asked again (the module's docstring).
_clear: set[str] = set()
_CLEAR_MAX = 4096  # Then forgotten all at once: a bound on memory, not on correctness.
_clear_lock = threading.Lock()


def _parents(path: epath.PathLike) -> list[str]:
    """The parents of ``path``, nearest first: every one locally (links resolved), the
    nearest ``OBJECT_STORE_LEVELS`` on an object store (down to the bucket)."""
    text = os.fspath(path).rstrip("/")
    if storage.is_local(text):
        current = os.path.realpath(text)
        parents = []
        while os.path.dirname(current) != current:
            current = os.path.dirname(current)
            parents.append(current)
        return parents
    scheme, _, rest = text.partition("://")
    parts = rest.split("/")  # bucket, then the key's components
    levels = range(len(parts) - 1, max(len(parts) - 1 - OBJECT_STORE_LEVELS, 0), -1)
    return [f"{scheme}://{'/'.join(parts[:n])}" for n in levels]


def enclosing_checkpoint(path: epath.PathLike) -> str | None:
    """The finished checkpoint that ``path`` lies in (see the module's docstring for how far
    up it looks), or ``None``. ``path`` itself does not count (a save's existence check
    handles it)."""
    parents = [p for p in _parents(path) if not layout.is_temporary_path(p)]
    if storage.is_local(path):  # A stat each: cheaper in turn than handed to threads.
        return next((p for p in parents if layout.is_checkpoint(p)), None)
    with _clear_lock:
        asked = [p for p in parents if p not in _clear]
    found = concurrently(layout.is_checkpoint, asked)
    with _clear_lock:
        if len(_clear) > _CLEAR_MAX:
            _clear.clear()
        _clear.update(p for p, is_one in zip(asked, found, strict=True) if not is_one)
    return next((p for p, is_one in zip(asked, found, strict=True) if is_one), None)


def forget(path: epath.PathLike) -> None:
    """A save to ``path`` starts, or commits: a checkpoint may be there, so ask again next
    time (a parent check that ran while it wrote found it clear)."""
    with _clear_lock:
        _clear.discard(os.fspath(path).rstrip("/"))


def refuse_inside(path: epath.PathLike) -> None:
    """Raises ``cp.errors.InvalidArgumentError`` if ``path`` lies in a finished checkpoint
    (this process looks; ``check_not_inside`` for a look by the primary host alone)."""
    forget(path)
    problem = _problem(path)
    if problem:
        raise errors.InvalidArgumentError(problem)


def check_not_inside(path: epath.Path, *, operation: str = "") -> None:
    """Raises ``cp.errors.InvalidArgumentError`` (on every process) if ``path`` lies in a
    finished checkpoint. The primary host looks and tells the others (one look, not one
    per process).

    Args:
      operation: the save's name among the processes' collective operations.
    """
    forget(path)
    primary = multihost.is_primary_host()
    problem = multihost.broadcast_from_primary(
        f"{operation}/inside", _problem(path) if primary else None
    )
    if problem:
        raise errors.InvalidArgumentError(problem)


def _problem(path: epath.PathLike) -> str:
    """Why a save must not write ``path`` (it is inside a finished checkpoint), or ``""``."""
    try:
        enclosing = enclosing_checkpoint(path)
    except errors.StorageError as e:  # It names a parent's marker: say which save asked.
        raise errors.StorageError(f"Saving {path}: {e}") from e
    if enclosing is None:
        return ""
    return (
        f"{path} is inside the finished checkpoint {enclosing}: saving there would add a "
        f"directory to that checkpoint (its checksums and `checkpointables verify` would no "
        f"longer match it, and deleting one could delete the other). Save to a path outside "
        f"{enclosing}, e.g. a sibling of it."
    )
