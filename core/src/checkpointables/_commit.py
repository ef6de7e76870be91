"""Publishing a save, and telling whether a checkpoint changed while it was read.

Two protocols, chosen by the storage of the path (``cp.storage``):

**Rename** (local disks, ``Storage.atomic_rename``). A save writes under a
temporary sibling (``<name>.checkpointables-tmp-<ns>-<pid>-<hex>``), flushes
it, and renames it into place; an overwrite swaps the two directories in one
atomic step (see ``layout.commit``). Readers see the old checkpoint or the
new one, never a mix.

**Marker** (object stores: no renames, no directories). A save writes in
place, under the checkpoint's own prefix, in this order:

1. ``.checkpointables-save``: a ``SaveRecord`` naming the save (who, when);
2. with ``overwrite``, the old ``commit_success.txt`` is deleted (from this
   moment readers see no checkpoint at the path), then the rest of the old
   checkpoint;
3. every handler's objects, ``_CHECKPOINT_METADATA`` and ``orbax.checkpoint``;
4. the record is read back: if another save took the prefix over meanwhile,
   this one stops without committing;
5. ``commit_success.txt``, the commit (Orbax marks finished checkpoints on
   object stores the same way): from this moment readers see the new
   checkpoint;
6. the record is deleted.

Readers count a prefix as a checkpoint only once ``commit_success.txt``
exists, so an interrupted save is never mistaken for a finished one. A load
remembers which checkpoint it opened (``Identity``) and checks at the end
that it is still the same one; if an overwrite replaced it meanwhile, the
load raises ``CheckpointChangedError`` (retry) instead of returning a mix or
blaming damage.
"""

from __future__ import annotations

import abc
import concurrent.futures
import functools
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from etils import epath

from checkpointables import _leftovers, errors, layout, metadata_checksums, multihost, storage

__all__ = [
    "SAVE_RECORD_FILE",
    "SaveTarget",
    "uses_rename",
    "resolve_final",
    "check_can_save",
    "write_root_for",
    "target_for",
    "Identity",
    "identity",
    "check_unchanged",
    "read_record",
    "occupied",
    "Retired",
    "retire",
    "remove_unfinished",
    "remove_abandoned",
]

SAVE_RECORD_FILE = ".checkpointables-save"


def uses_rename(path: epath.PathLike) -> bool:
    """Whether saves to ``path`` commit by renaming a temporary directory (local disks)."""
    return storage.for_path(path).atomic_rename


def _join(path: epath.PathLike, name: str) -> str:
    return f"{os.fspath(path).rstrip('/')}/{name}"


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for the many small requests of deleting a checkpoint on an object store."""
    return concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="checkpointables-delete")


def _remove_all(store: storage.Storage, paths: Sequence[str]) -> None:
    for future in [_pool().submit(store.remove_file, p) for p in paths]:
        future.result()


# -- Before a save ----------------------------------------------------------------------------


def resolve_final(path: epath.Path) -> epath.Path:
    """The directory a save to ``path`` replaces: a symbolic link's target, else ``path``.

    Saving through a link writes where it points (as ``open()`` writes through
    one) and keeps the link, so ``latest -> 1000`` stays a link.
    """
    text = os.fspath(path)
    if storage.is_local(text) and os.path.islink(text):
        return epath.Path(os.path.realpath(text))
    return path


def read_record(
    path: epath.PathLike, store: storage.Storage | None = None
) -> _leftovers.SaveRecord | None:
    """The ``SaveRecord`` of an object-store checkpoint's prefix, or ``None``."""
    store = storage.for_path(path) if store is None else store
    try:
        return _leftovers.SaveRecord.from_json(store.read_bytes(_join(path, SAVE_RECORD_FILE)))
    except FileNotFoundError:
        return None


def check_can_save(
    path: epath.Path,
    *,
    overwrite: bool,
    replace_unfinished: bool,
    timeout_secs: float,
    operation: str = "",
) -> None:
    """Raises ``FileExistsError`` (on every process) if a save to ``path`` must not start.

    The primary host looks, and tells the others: once it has claimed an
    object-store prefix, the others would take its claim for another save.

    Args:
      overwrite: replace a finished checkpoint (or anything else) at ``path``.
      replace_unfinished: replace an unfinished save on an object store even if
        it may still be running (the Checkpointer, sole writer of its root).
      timeout_secs: an unfinished save older than this is abandoned.
      operation: the save's name among the processes' collective operations.
    """
    problem = ""
    if multihost.is_primary_host():
        try:
            _check_can_save(path, overwrite, replace_unfinished, timeout_secs)
        except FileExistsError as e:
            problem = str(e)
    problem = multihost.broadcast_from_primary(
        f"{operation}/check", problem if multihost.is_primary_host() else None
    )
    if problem:
        raise errors.CheckpointExistsError(problem)


def _check_can_save(
    path: epath.Path, overwrite: bool, replace_unfinished: bool, timeout_secs: float
) -> None:
    if uses_rename(path):
        if os.path.lexists(os.fspath(path)) and not overwrite:
            raise errors.CheckpointExistsError(
                f"{path} already exists. Pass overwrite=True to replace it (the old checkpoint is "
                f"removed only after the new one is complete), or choose another path."
            )
        return
    names = {e.name for e in storage.for_path(path).list_dir(os.fspath(path))}
    if not names or overwrite:
        return
    if layout.COMMIT_SUCCESS_FILE in names:
        raise errors.CheckpointExistsError(
            f"{path} already holds a checkpoint. Pass overwrite=True to replace it (on an object "
            f"store the old one stops being a checkpoint as soon as the new save starts writing; "
            f"see docs/object-stores.md), or choose another path."
        )
    record = read_record(path) if SAVE_RECORD_FILE in names else None
    if replace_unfinished or _leftovers.record_is_abandoned(record, timeout_secs=timeout_secs):
        return
    what = (
        f"an unfinished save ({record.describe()}) that may still be running"
        if record is not None
        else f"objects but no finished checkpoint (no {layout.COMMIT_SUCCESS_FILE}; not written "
        f"by this library, or by an older version)"
    )
    raise errors.CheckpointExistsError(
        f"{path} holds {what}. Pass overwrite=True to replace it, choose another path, or wait: "
        f"an unfinished save is cleaned by the next save once its process is gone or after "
        f"AsyncOptions.timeout_secs ({timeout_secs:g} s)."
    )


def write_root_for(path: epath.Path) -> epath.Path:
    """Where a save to ``path`` writes: a fresh temporary sibling, or ``path`` itself."""
    return layout.temporary_path_for(path) if uses_rename(path) else path


def target_for(
    final: epath.Path, root: epath.Path, *, overwrite: bool, timeout_secs: float
) -> SaveTarget:
    """The protocol that publishes a save written at ``root`` as ``final``."""
    if uses_rename(final):
        return RenameTarget(final, root, overwrite=overwrite, timeout_secs=timeout_secs)
    return MarkerTarget(final, root, overwrite=overwrite, timeout_secs=timeout_secs)


# -- Saving -----------------------------------------------------------------------------------


class SaveTarget(abc.ABC):
    """How one save is staged and published. Only the primary host calls the methods.

    Attributes:
      final: the checkpoint's path.
      root: where the handlers write (a temporary directory, or ``final``).
    """

    def __init__(
        self, final: epath.Path, root: epath.Path, *, overwrite: bool, timeout_secs: float
    ) -> None:
        self.final = final
        self.root = root
        self.overwrite = overwrite
        self.timeout_secs = timeout_secs

    @abc.abstractmethod
    def create(self, names: Iterable[str], mode: int | None) -> None:
        """Makes ``root`` and a subdirectory per checkpointable ready for writing."""

    @abc.abstractmethod
    def publish(self, files: Mapping[str, str], marker: str) -> None:
        """Writes ``files`` (name -> text) into ``root``, then commits with ``marker`` last."""

    @abc.abstractmethod
    def discard(self) -> None:
        """Removes what this save wrote, after a failure (nothing is committed)."""


class RenameTarget(SaveTarget):
    """Local disks: a temporary directory, flushed and renamed into place."""

    def create(self, names: Iterable[str], mode: int | None) -> None:
        """Cleans abandoned temporary siblings, then creates the temporary directory."""
        _remove_abandoned_siblings(self.final, self.timeout_secs)
        mode = 0o777 if mode is None else mode
        self.root.mkdir(mode=mode)
        for name in names:
            (self.root / name).mkdir(mode=mode)

    def publish(self, files: Mapping[str, str], marker: str) -> None:
        """Writes the files and the checksums of the metadata, flushes everything, renames (or
        swaps) into place."""
        for name, text in {**files, layout.COMMIT_SUCCESS_FILE: marker}.items():
            layout.write_file(self.root / name, text)
        metadata_checksums.record(self.root)
        layout.fsync_tree(self.root)
        layout.commit(self.root, self.final, overwrite=self.overwrite)

    def discard(self) -> None:
        """Deletes the temporary directory."""
        layout.remove_tree(self.root)


def _remove_abandoned_siblings(final: epath.Path, timeout_secs: float) -> None:
    """Deletes temporary directories of dead saves next to ``final`` (never a live one's)."""
    for entry in _leftovers.abandoned_entries([final.parent], timeout_secs=timeout_secs):
        _leftovers.remove(entry)


class MarkerTarget(SaveTarget):
    """Object stores: written in place, committed by ``commit_success.txt`` written last."""

    def __init__(
        self, final: epath.Path, root: epath.Path, *, overwrite: bool, timeout_secs: float
    ) -> None:
        super().__init__(final, root, overwrite=overwrite, timeout_secs=timeout_secs)
        self._store = storage.for_path(final)
        self._record = _leftovers.SaveRecord.new()

    def create(self, names: Iterable[str], mode: int | None) -> None:
        """Claims the prefix with this save's record, then clears what was there.

        The old checkpoint's marker goes first: from then on nobody reads it.
        """
        self._store.write_bytes(
            _join(self.final, SAVE_RECORD_FILE), self._record.to_json().encode()
        )
        old = [f for f in self._store.list_files(os.fspath(self.final)) if f != SAVE_RECORD_FILE]
        if layout.COMMIT_SUCCESS_FILE in old:
            self._store.remove_file(_join(self.final, layout.COMMIT_SUCCESS_FILE))
            old.remove(layout.COMMIT_SUCCESS_FILE)
        _remove_all(self._store, [_join(self.final, f) for f in old])

    def publish(self, files: Mapping[str, str], marker: str) -> None:
        """Writes the files and the checksums of the metadata, checks the prefix is still this
        save's, writes the marker."""
        for name, text in files.items():
            self._store.write_bytes(_join(self.final, name), text.encode())
        metadata_checksums.record(self.final)
        if read_record(self.final, self._store) != self._record:
            raise errors.CheckpointExistsError(
                f"Another save to {self.final} started while this one was writing, so this one "
                f"was not committed (two saves must not write one path at once). The other "
                f"save's result, if it finishes, is what the path will hold."
            )
        self._store.write_bytes(_join(self.final, layout.COMMIT_SUCCESS_FILE), marker.encode())
        self._store.remove_file(_join(self.final, SAVE_RECORD_FILE))

    def discard(self) -> None:
        """Deletes what this save wrote, unless another save has taken the prefix over."""
        if read_record(self.final, self._store) == self._record:
            remove_unfinished(self.final, self._store)


# -- Deleting ---------------------------------------------------------------------------------


def occupied(path: epath.Path) -> bool:
    """Whether a save to ``path`` would replace something.

    Local: anything at the path. Object stores: a committed checkpoint (an
    unfinished save there is a leftover the Checkpointer replaces).
    """
    if uses_rename(path):
        return os.path.lexists(os.fspath(path))
    return storage.is_file(_join(path, layout.COMMIT_SUCCESS_FILE))


class Retired:
    """A checkpoint nobody sees any more, whose files are still to be removed."""

    def __init__(self, path: epath.Path) -> None:
        self.path = path

    def remove(self) -> None:
        """Removes the files (an interrupted removal is finished by the next cleanup)."""
        if uses_rename(self.path):
            layout.remove_tree(self.path)
        else:
            remove_unfinished(self.path)


def retire(path: epath.Path) -> Retired | None:
    """Makes a committed checkpoint invisible at once; ``None`` if it is already gone.

    Local: renamed to a ``.checkpointables-old-`` name. Object stores: a
    deletion record, then the marker is deleted (the rest stays until
    ``Retired.remove``).
    """
    if uses_rename(path):
        aside = layout.temporary_path_for(path, layout.OLD_INFIX)
        try:
            os.rename(os.fspath(path), os.fspath(aside))
        except FileNotFoundError:
            return None
        return Retired(aside)
    store = storage.for_path(path)
    record = _leftovers.SaveRecord.new(deleting=True)
    store.write_bytes(_join(path, SAVE_RECORD_FILE), record.to_json().encode())
    store.remove_file(_join(path, layout.COMMIT_SUCCESS_FILE))
    return Retired(path)


def remove_unfinished(path: epath.Path, store: storage.Storage | None = None) -> None:
    """Deletes an object-store prefix that holds no committed checkpoint, record last."""
    store = storage.for_path(path) if store is None else store
    files = store.list_files(os.fspath(path))
    _remove_all(store, [_join(path, f) for f in files if f != SAVE_RECORD_FILE])
    store.remove_file(_join(path, SAVE_RECORD_FILE))


def remove_abandoned(prefixes: Iterable[epath.Path], *, timeout_secs: float) -> None:
    """Removes the object-store prefixes among ``prefixes`` whose record proves them abandoned.

    Prefixes without a record (not written by this library) are left alone.
    """
    for prefix in prefixes:
        record = read_record(prefix)
        if _leftovers.record_is_abandoned(record, timeout_secs=timeout_secs) and not (
            storage.is_file(_join(prefix, layout.COMMIT_SUCCESS_FILE))
        ):
            remove_unfinished(prefix)


# -- Reading ----------------------------------------------------------------------------------

Identity = Any  # Comparable: equal identities mean the same committed checkpoint.


def identity(path: epath.Path) -> Identity:
    """What tells this committed checkpoint from one that replaces it at the same path.

    Local: the directory's inode (an overwrite swaps in another directory).
    Object stores: the contents of ``commit_success.txt`` (ours holds the
    commit time). ``None`` when nothing is committed there (any more).
    """
    text = os.fspath(path)
    if uses_rename(text):
        try:
            stat = os.stat(text)
        except OSError:
            return None
        return (stat.st_dev, stat.st_ino)
    try:
        return storage.read_bytes(_join(text, layout.COMMIT_SUCCESS_FILE))
    except FileNotFoundError:
        return None


def check_unchanged(path: epath.Path, opened: Identity, error: BaseException | None) -> None:
    """Raises ``CheckpointChangedError`` if ``path`` is no longer the checkpoint that was opened.

    Called at the end of a load (``error`` is its failure, if any): a load
    that raced an overwrite or a deletion then says so, instead of returning
    a mix of two checkpoints or reporting damage.
    """
    if opened is not None and identity(path) == opened:
        return
    message = (
        f"The checkpoint at {path} was replaced or deleted while it was being read (a save with "
        f"overwrite=True, or a deletion, ran meanwhile). Nothing is damaged: load it again."
    )
    raise errors.CheckpointChangedError(message) from error
