"""Publishing a save, and telling whether a checkpoint changed while it was read.

Two protocols, chosen by the storage of the path (``cp.storage``):

**Rename** (local disks, ``Storage.atomic_rename``). A save writes under a
temporary sibling (``<name>.checkpointables-tmp-<ns>-<pid>-<hex>``), flushes
it, and renames it into place; an overwrite swaps the two directories in one
atomic step (see ``layout.commit``). Readers see the old checkpoint or the
new one, never a mix.

**Marker** (object stores: no renames, no directories). A save writes in
place, under the checkpoint's own prefix, in this order:

1. the prefix is listed: an object the start's check (``Occupant``, every key)
   did not list stops the save before it writes or removes anything (a user's,
   put there since: ``MarkerTarget._refuse_objects_put_since_the_check``);
2. ``.checkpointables-save``: a ``SaveRecord`` naming the save (who, when);
   then, with ``overwrite``, the old ``commit_success.txt`` is deleted (from
   this moment readers see no checkpoint at the path), then the rest of what
   the check listed, nothing else;
3. every handler's objects, ``_CHECKPOINT_METADATA`` and ``orbax.checkpoint``;
4. the record is read back: if another save took the prefix over meanwhile,
   this one stops without committing; it also lists the prefix again (in the
   same round trip: one LIST more), and if names it did not write
   appeared at its top meanwhile (a user's objects), it removes its own objects
   and stops without committing, leaving those as they are (the local rule of
   ``RenameTarget._refuse_what_appeared``); objects put inside its own folders
   are not told from its own (only the handlers know their keys:
   docs/object-stores.md);
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
import contextlib
import functools
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
from etils import epath

from checkpointables import (
    _enclosing,
    _leftovers,
    errors,
    handlers,
    layout,
    metadata_checksums,
    multihost,
    options,
    protocols,
    storage,
)
from checkpointables._asyncio import concurrently
from checkpointables._leftovers import SAVE_RECORD_FILE, read_record
from checkpointables.checkpoint_metadata import CHECKPOINT_METADATA_FILE, read_checkpoint_metadata
from checkpointables.metadata_checksums import CHECKSUMS_FILE

__all__ = [
    "SAVE_RECORD_FILE",
    "SaveTarget",
    "uses_rename",
    "marker",
    "resolve_final",
    "check_can_save",
    "clear_to_save",
    "Occupant",
    "write_root_for",
    "target_for",
    "Identity",
    "MAX_MARKER_BYTES",
    "identity",
    "check_unchanged",
    "read_record",
    "occupied",
    "Retired",
    "retire",
    "committed_after_refusal",
]


def uses_rename(path: epath.PathLike) -> bool:
    """Whether saves to ``path`` commit by renaming a temporary directory (local disks)."""
    return storage.for_path(path).atomic_rename


def _join(path: epath.PathLike, name: str) -> str:
    return f"{os.fspath(path).rstrip('/')}/{name}"


def marker(path: epath.PathLike) -> str:
    """The text of the commit marker of a save to ``path``: Orbax's, the commit time, and that
    the save records ``_CHECKSUMS`` (every save does: see ``metadata_checksums.check_recorded``)."""
    recorded = metadata_checksums.RECORDED_MARK
    return f"Checkpoint commit was successful to {path}\n{time.time_ns()}\n{recorded}\n"


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


def check_can_save(
    path: epath.Path,
    *,
    overwrite: bool,
    replace_unfinished: bool,
    timeout_secs: float,
    operation: str = "",
) -> bool:
    """``clear_to_save`` (without the look for an enclosing checkpoint); returns whether the
    save replaces a committed checkpoint (the primary host's answer; the others get
    ``False``)."""
    found = clear_to_save(
        path,
        overwrite=overwrite,
        replace_unfinished=replace_unfinished,
        timeout_secs=timeout_secs,
        operation=operation,
    )
    return found is not None and found.committed


def clear_to_save(
    path: epath.Path,
    *,
    overwrite: bool,
    replace_unfinished: bool,
    timeout_secs: float,
    operation: str = "",
    not_inside: bool = False,
) -> Occupant | None:
    """Raises (on every process) if a save to ``path`` must not start.

    The primary host looks (one listing of ``path``), and tells the others in one broadcast:
    once it has claimed an object-store prefix, the others would take its claim for another
    save.

    Args:
      overwrite: replace what a save may replace (``Occupant.replaceable``): a checkpoint,
        finished or not, or leftovers of saves; never a directory of checkpoints, nor files
        that no save wrote.
      replace_unfinished: replace an unfinished save on an object store even if it may
        still be running (the Checkpointer, sole writer of its root).
      timeout_secs: an unfinished save older than this is abandoned.
      operation: the save's name among the processes' collective operations.
      not_inside: look first for a finished checkpoint that ``path`` lies in
        (``_enclosing``), told in the same broadcast.

    Returns:
      What the primary host found at ``path`` (the others get ``None``): the save's
      commit checks that it did not change meanwhile (``SaveTarget``).

    Raises:
      cp.errors.InvalidArgumentError: ``path`` lies in a finished checkpoint.
      cp.errors.CheckpointExistsError: what is at ``path`` must not be replaced.
    """
    _enclosing.forget(path)  # A save to it starts: it may commit a checkpoint there.
    found, answer = None, {"inside": "", "exists": ""}
    if multihost.is_primary_host():
        answer["inside"] = _enclosing.problem(path) if not_inside else ""
        if not answer["inside"]:
            found = Occupant.at(path)
            answer["exists"] = found.refusal(overwrite, replace_unfinished, timeout_secs)
            if answer["exists"]:
                # Not kept by the error's traceback (a caller's, an interactive session's):
                # on an object store it holds every key listed.
                found = None
    told = json.loads(
        multihost.broadcast_from_primary(
            f"{operation}/check", json.dumps(answer) if multihost.is_primary_host() else None
        )
    )
    if told["inside"]:
        raise errors.InvalidArgumentError(told["inside"])
    if told["exists"]:
        raise errors.CheckpointExistsError(told["exists"])
    return found


# Top-level files that only a checkpoint holds (ours or Orbax's; finished, damaged, or being
# written): a path holding one is a checkpoint, which ``overwrite=True`` may replace.
_CHECKPOINT_FILES = frozenset(
    {
        CHECKPOINT_METADATA_FILE,
        layout.COMMIT_SUCCESS_FILE,
        CHECKSUMS_FILE,
        layout.MARKER_FILE,
        SAVE_RECORD_FILE,
    }
)
# Files that say by themselves that a save wrote the directory (``orbax.checkpoint`` and
# ``_CHECKSUMS`` alone do not: a stray copy of either beside a user's files proves nothing).
_WRITTEN_BY_A_SAVE = frozenset(
    {CHECKPOINT_METADATA_FILE, layout.COMMIT_SUCCESS_FILE, SAVE_RECORD_FILE}
)
_SHOWN = 8  # The most names an error lists.


def _is_leftover(name: str, directory: epath.PathLike | None = None) -> bool:
    """Whether ``name`` (in ``directory``, if known) is an unfinished save's temporary
    directory (ours or Orbax's); not a ``cp.partial`` session, which holds saves waiting for
    ``finalize``, nor the directory of a save that may still be writing (``_may_be_writing``)."""
    return (
        layout.is_temporary_path(name)
        and layout.PARTIAL_SESSION_SUFFIX not in name
        and not _may_be_writing(name, directory)
    )


# No save writes longer than the default wait for background work (AsyncOptions).
_LONGEST_SAVE_NS = int(options.AsyncOptions().timeout_secs * 1e9)


def _may_be_writing(name: str, directory: epath.PathLike | None = None) -> bool:
    """Whether our temporary directory ``name`` may belong to a save still writing. An
    overwrite of the directory holding it would delete that save's work.

    In ``directory`` (where the heartbeat is read), a save that keeps a heartbeat
    (``_leftovers``): its heartbeat is fresh, whatever its age and its host, and its process
    is not gone from this host. Else (an older version's name, or no ``directory``): its
    process (named in it) runs on this host, and it is younger than any save lasts.
    """
    parsed = layout.parse_temporary_name(name)
    if parsed is None:
        return False
    _, created_ns, pid = parsed
    alive_ns = None if directory is None else _leftovers.heartbeat_ns(directory, name)
    if alive_ns is not None:
        here = bool(_leftovers.name_host(name))
        gone = here and pid != os.getpid() and not _leftovers.process_exists(pid)
        return time.time_ns() - alive_ns < _LONGEST_SAVE_NS and not gone
    # A time to come (another host's clock, or a forged name) or no pid proves nothing.
    age_ns = time.time_ns() - created_ns
    return 0 <= age_ns < _LONGEST_SAVE_NS and pid > 0 and _leftovers.process_exists(pid)


def _shown(names: Iterable[str]) -> str:
    names = sorted(names)
    more = f", ... ({len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


@attrs.frozen
class Occupant:
    """What is at a save's path, from one listing of it.

    Attributes:
      path: the path.
      exists: something is there (locally: even an empty directory).
      names: the names directly inside it (``None``: a local file, not a directory).
      files: those of ``names`` that are files.
      keys: on an object store, every object under it (relative keys): all that a save to
        it may delete as it starts (``MarkerTarget.create``, which then empties them);
        ``None`` on a local disk.
    """

    path: epath.Path
    exists: bool
    names: frozenset[str] | None
    files: frozenset[str] = frozenset()
    keys: frozenset[str] | None = None

    @classmethod
    def at(cls, path: epath.Path) -> Occupant:
        """Lists ``path`` (on an object store one listing, of every key, paged by 1,000: the
        store lists keys, not top-level names, so ``storage.list_dir`` would page through
        every key too; one listing gives the names and the keys)."""
        text = os.fspath(path)
        local = uses_rename(text)
        if local and os.path.lexists(text) and not os.path.isdir(text):
            return cls(path, True, None)
        if not local:
            keys = frozenset(storage.list_files(path))
            names = frozenset(k.split("/")[0] for k in keys)
            return cls(path, bool(keys), names, frozenset(k for k in keys if "/" not in k), keys)
        entries = storage.list_dir(path)
        return cls(
            path,
            os.path.lexists(text) if local else bool(entries),
            frozenset(e.name for e in entries),
            frozenset(e.name for e in entries if not e.is_dir),
        )

    @property
    def commit_file(self) -> str:
        """The file whose presence makes the path a committed checkpoint (see ``layout``)."""
        return CHECKPOINT_METADATA_FILE if uses_rename(self.path) else layout.COMMIT_SUCCESS_FILE

    @property
    def committed(self) -> bool:
        """Whether a committed checkpoint is there."""
        return self.commit_file in self.files

    @property
    def is_checkpoint(self) -> bool:
        """Whether a checkpoint is there: finished, damaged, or a save's unfinished one."""
        return bool(self.files & _CHECKPOINT_FILES)

    def replaceable(self, *, in_own_root: bool = False) -> bool:
        """Whether ``overwrite=True`` may replace it: nothing or an empty directory, only the
        temporary directories of saves that did not finish, or a checkpoint holding nothing
        but what saves write (see ``unexplained``). ``in_own_root``: a step of the
        Checkpointer that is its root's sole writer, where any file of a checkpoint marks
        what an interrupted save left (an older version's, or Orbax's)."""
        if self.names is None:
            return False
        return (in_own_root and self.is_checkpoint) or not self.unexplained()

    def unexplained(self) -> list[str]:
        """The names here that no save wrote: every name but leftovers unless a file says a
        save wrote the directory; else what is not a checkpoint's file nor named by its own
        records (never steps, nested checkpoints or a user's files)."""
        rest = {n for n in self.names or () if not _is_leftover(n, self.path)}
        if not rest or not self.files & _WRITTEN_BY_A_SAVE:
            return sorted(rest)
        foreign: set[str] = set(self.files - _CHECKPOINT_FILES) | (rest - self.files)
        if foreign and self._being_saved():  # Its checkpointables, not yet named.
            foreign &= self.files
        if foreign:  # Read only when needed: one request on an object store.
            own = _own_names(self.path)
            foreign = set() if own is None else foreign - own
        return sorted(foreign)

    def _being_saved(self) -> bool:
        """Whether a save of ours writes here (or did, unfinished): its record says so, and
        the directories are its checkpointables, not yet named by any metadata."""
        if SAVE_RECORD_FILE not in self.files:
            return False
        with contextlib.suppress(errors.CheckpointError, OSError, ValueError):
            return read_record(self.path) is not None
        return False

    def refusal(self, overwrite: bool, replace_unfinished: bool, timeout_secs: float) -> str:
        """Why a save must not replace it, or ``""``."""
        if not self.replaceable(in_own_root=replace_unfinished):
            return self._not_replaceable()
        if overwrite or not self.exists:
            return ""
        if not uses_rename(self.path):
            return self._unfinished(replace_unfinished, timeout_secs)
        what = f"holds {self._what()}" if self.names else "exists (an empty directory)"
        return (
            f"{self.path} already {what}. Pass overwrite=True to replace it (it is removed "
            f"only after the new checkpoint is complete), or choose another path."
        )

    def _what(self) -> str:
        if self.committed:
            return "a checkpoint"
        if self.is_checkpoint:
            return (
                f"a checkpoint that is damaged or was not finished (it has "
                f"{_shown(self.files & _CHECKPOINT_FILES)}, but no {self.commit_file})"
            )
        return (
            f"only temporary directories of saves that did not finish ({_shown(self.names or ())})"
        )

    def _not_replaceable(self) -> str:
        """The refusal for what no save replaces, ``overwrite=True`` or not."""
        if self.names is None:
            return (
                f"{self.path} is a file, not a checkpoint: a save never replaces it, even with "
                f"overwrite=True. Choose another path, or remove it yourself."
            )
        steps = _checkpoints_among(self.path, self.names - self.files)
        if steps:
            # Checkpointer advice only for a root of steps (not for "other, nx_orbax").
            if all(layout.is_step_name(s) for s in steps):
                instead = f"<step>, or use cp.training.Checkpointer({os.fspath(self.path)!r})"
            else:
                instead = "<name>"
            return (
                f"{self.path} is not a checkpoint but {layout.checkpoints_holder(sorted(steps))}: "
                f"a save never replaces it, even with overwrite=True. Save to "
                f"{self.path}/{instead}."
            )
        unexplained = self.unexplained()
        writing = [n for n in unexplained if _may_be_writing(n, self.path)]
        if writing:
            return (
                f"{self.path} holds {_shown(writing)}, the work of a save still writing there: "
                f"a save never replaces it, even with overwrite=True. Wait for that save to "
                f"finish, or choose another path."
            )
        return (
            f"{self.path} holds {_shown(unexplained)}, which no checkpoint's metadata or "
            f"save record accounts for. A save replaces only a checkpoint (or what an "
            f"unfinished save left), never anything else, even with overwrite=True: choose "
            f"another path, or, if this is a damaged, older or foreign checkpoint or files you "
            f"no longer need, remove it yourself."
        )

    def _unfinished(self, replace_unfinished: bool, timeout_secs: float) -> str:
        """The refusal, on an object store, of a checkpoint or an unfinished save."""
        if self.committed:
            return (
                f"{self.path} already holds a checkpoint. Pass overwrite=True to replace it (on "
                f"an object store the old one stops being a checkpoint as soon as the new save "
                f"starts writing; see docs/object-stores.md), or choose another path."
            )
        record = read_record(self.path) if SAVE_RECORD_FILE in self.files else None
        if replace_unfinished or _leftovers.record_is_abandoned(record, timeout_secs=timeout_secs):
            return ""
        what = (
            f"an unfinished save ({record.describe()}) that may still be running"
            if record is not None
            else f"{self._what()}, not written by this library (or by an older version)"
        )
        return (
            f"{self.path} holds {what}. Pass overwrite=True to replace it, choose another path, "
            f"or wait: an unfinished save is cleaned by the next save once its process is gone "
            f"or its heartbeat is older than AsyncOptions.timeout_secs ({timeout_secs:g} s)."
        )


def _own_names(path: epath.Path) -> frozenset[str] | None:
    """The top-level names a checkpoint's own records give it: its checkpointables (in
    ``_CHECKPOINT_METADATA``), else what its ``_CHECKSUMS`` covers (one that lost its
    metadata); empty where neither can be read. ``None``: a pytree saved directly at the
    top (Orbax V0's ``StandardCheckpointer``: ``item_handlers`` one typestr), which the
    pytree plugin recognizes; all it holds is its own."""
    with contextlib.suppress(errors.CheckpointError, OSError, ValueError):
        item_handlers = read_checkpoint_metadata(path).get("item_handlers")
        if isinstance(item_handlers, Mapping):
            return frozenset(map(str, item_handlers))
        if isinstance(item_handlers, str) and _recognized(path):
            return None
    return metadata_checksums.covered_top_level_names(path)


def _recognized(path: epath.Path) -> bool:
    """Whether a registered handler recognizes ``path`` as its own (``cp.protocols.
    Recognizing``: core knows nothing of a handler's files)."""
    return any(
        issubclass(r.handler_cls, protocols.Recognizing) and r.handler_cls.recognizes(path)
        for r in handlers.registered_handlers()
    )


def _checkpoints_among(path: epath.Path, names: Iterable[str]) -> list[str]:
    """Which of the directories ``names`` in ``path`` hold a committed checkpoint (steps).
    Asks about the first few only (one request each on an object store, issued together):
    enough to name them in an error."""
    commit = CHECKPOINT_METADATA_FILE if uses_rename(path) else layout.COMMIT_SUCCESS_FILE
    candidates = sorted(n for n in names if not _is_leftover(n, path))[: 4 * _SHOWN]
    found = concurrently(storage.is_file, [_join(_join(path, n), commit) for n in candidates])
    return [n for n, is_step in zip(candidates, found, strict=True) if is_step]


def write_root_for(path: epath.Path) -> epath.Path:
    """Where a save to ``path`` writes: a fresh temporary sibling, or ``path`` itself."""
    return layout.temporary_path_for(path) if uses_rename(path) else path


def target_for(
    final: epath.Path,
    root: epath.Path,
    *,
    overwrite: bool,
    found: Occupant | None = None,
    in_own_root: bool = False,
    assembled: bool = False,
) -> SaveTarget:
    """The protocol that publishes a save written at ``root`` as ``final``.

    Args:
      found: what ``clear_to_save`` found at ``final`` (the primary host's).
      in_own_root: the save is the Checkpointer's, its root's sole writer
        (``Occupant.replaceable``).
      assembled: ``root`` holds a partial session's committed saves (``cp.partial.finalize``):
        a refused commit keeps them, so that ``finalize`` can run again.
    """
    cls = RenameTarget if uses_rename(final) else MarkerTarget
    return cls(
        final, root, overwrite=overwrite, found=found, in_own_root=in_own_root, assembled=assembled
    )


# -- Saving -----------------------------------------------------------------------------------


class SaveTarget(abc.ABC):
    """How one save is staged and published. Only the primary host calls the methods.

    Attributes:
      final: the checkpoint's path.
      root: where the handlers write (a temporary directory, or ``final``).
      found: what was at ``final`` as the save started (``clear_to_save``), if known.
      in_own_root: the save is the Checkpointer's, its root's sole writer.
      assembled: ``root`` holds a partial session's committed saves, kept if the commit
        is refused.
    """

    def __init__(
        self,
        final: epath.Path,
        root: epath.Path,
        *,
        overwrite: bool,
        found: Occupant | None = None,
        in_own_root: bool = False,
        assembled: bool = False,
    ) -> None:
        self.final = final
        self.root = root
        self.overwrite = overwrite
        self.found = found
        self.in_own_root = in_own_root
        self.assembled = assembled

    @abc.abstractmethod
    def create(self, names: Iterable[str], mode: int | None) -> None:
        """Makes ``root`` and a subdirectory per checkpointable ready for writing."""

    @abc.abstractmethod
    def claim(self, *, again: bool = False) -> None:
        """Marks ``root`` as being written by this save (``create`` does it too); ``again``:
        refreshes the mark, the save's heartbeat (``_leftovers``), if it is still this save's."""

    @abc.abstractmethod
    def publish(
        self, files: Mapping[str, str], marker: str, check: _enclosing.Recheck | None = None
    ) -> None:
        """Writes ``files`` (name -> text, a name may hold one ``/``) into ``root`` and the
        checksums of its metadata files, then commits with ``marker`` last; ``check``
        refuses the commit if a parent became a finished checkpoint meanwhile."""

    @abc.abstractmethod
    def discard(self) -> None:
        """Removes what this save wrote, after a failure (nothing is committed)."""

    def explained(self, error: BaseException) -> BaseException:
        """The error to raise for ``error``, a failure of the save's writes: itself, unless
        the target can say better what happened (``RenameTarget``'s deleted directory)."""
        return error


class RenameTarget(SaveTarget):
    """Local disks: a temporary directory, flushed and renamed into place."""

    created = False  # ``create`` made the directory (saves make it when a handler asks).

    def create(self, names: Iterable[str], mode: int | None) -> None:
        """Creates the temporary directory and its subdirectories."""
        mode = 0o777 if mode is None else mode
        self.root.mkdir(mode=mode)
        self.created = True
        for name in names:
            (self.root / name).mkdir(mode=mode)

    def claim(self, *, again: bool = False) -> None:
        """The temporary directory's name says whose it is; ``again`` sets its modification
        time, the save's heartbeat (one ``utime``)."""
        if again:
            with contextlib.suppress(FileNotFoundError):  # Committed or discarded: no save.
                os.utime(self.root)

    def publish(
        self, files: Mapping[str, str], marker: str, check: _enclosing.Recheck | None = None
    ) -> None:
        """Writes the files and the checksums, flushes everything, looks at the path again,
        renames (or swaps) into place."""
        written = {n: t.encode() for n, t in {**files, layout.COMMIT_SUCCESS_FILE: marker}.items()}
        try:
            if not storage.is_dir(self.root):  # Else the metrics' make_dirs would recreate it.
                raise FileNotFoundError(self.root)
            for name, data in written.items():
                if "/" in name:  # In a directory of its own (the metrics item).
                    storage.make_dirs((self.root / name).parent)
                storage.write_bytes(self.root / name, data)
        except FileNotFoundError as e:
            if (explained := self.explained(e)) is e:
                raise
            raise explained from e
        metadata_checksums.record(self.root, known=written)
        layout.fsync_tree(self.root)
        if check is not None:
            check.now()  # A stat each.
        if self.overwrite:
            self._refuse_what_appeared()
        layout.commit(self.root, self.final, overwrite=self.overwrite)

    def _refuse_what_appeared(self) -> None:
        """Raises ``CheckpointExistsError`` if what is at ``final`` changed since the save
        started into something no save replaces (a user's files put there while it wrote).

        The start's check (``clear_to_save``) ran a whole save earlier; the swap that follows
        would otherwise replace, then delete, whatever came meanwhile. One listing (a few
        syscalls); the full check (which may read the metadata) only if it changed. What
        comes between this listing and the swap (microseconds) is not seen.
        """
        now = Occupant.at(self.final)
        before = self.found
        if before is not None and (now.exists, now.names, now.files) == (
            before.exists,
            before.names,
            before.files,
        ):
            return
        if now.replaceable(in_own_root=self.in_own_root):
            return
        raise errors.CheckpointExistsError(
            f"{self.final} changed while this save was writing ({_appeared(before, now)} "
            f"appeared there): {now._not_replaceable()} This save was not "
            f"committed and its files were discarded; what is at {self.final} was left as it "
            f"is."
        )

    def explained(self, error: BaseException) -> BaseException:
        """``error``, or, for a ``FileNotFoundError`` met while the temporary directory is
        gone (a handler, another process or a cleanup of temporary directories deleted it),
        the ``StorageError`` that says so: the file it names is only a symptom. (A directory
        never made, or not yet discarded, is no explanation: the error is the handler's.)"""
        if not isinstance(error, FileNotFoundError) or not self.created:
            return error
        if storage.is_dir(self.root):
            return error
        vanished = errors.StorageError(
            f"{self.root}, where this save wrote {self.final}, was deleted while it was "
            f"writing (by one of its handlers, another process, or a cleanup of temporary "
            f"directories): nothing was committed. Save again."
        )
        vanished.__cause__ = error
        return vanished

    def discard(self) -> None:
        """Deletes the temporary directory."""
        storage.remove_tree(self.root)


class MarkerTarget(SaveTarget):
    """Object stores: written in place, committed by ``commit_success.txt`` written last."""

    @functools.cached_property
    def _record(self) -> _leftovers.SaveRecord:
        """This save's record (made once, as the save claims the prefix)."""
        replacing = self.overwrite and self.found is not None and self.found.committed
        return _leftovers.SaveRecord.new(replacing=replacing)

    def create(self, names: Iterable[str], mode: int | None) -> None:
        """Lists the prefix, claims it with this save's record, then clears what was there:
        what the start's check listed (``found``), never what appeared since (refused
        before anything is written: ``_refuse_objects_put_since_the_check``). One LIST,
        one PUT, a DELETE per old object, as when the claim came first.

        The old checkpoint's marker goes first: from then on nobody reads it.
        """
        seen = None if self.found is None else self.found.keys
        if self.found is not None and seen is not None:  # Used once: not held as it writes.
            self.found = attrs.evolve(self.found, keys=frozenset())
        old = [f for f in storage.list_files(self.final) if f != SAVE_RECORD_FILE]
        self._refuse_objects_put_since_the_check(old, seen)
        del seen  # Not held through the DELETEs (a large checkpoint's take a while).
        # Objects put after this listing are not deleted; at the top, they stop the commit.
        self.claim()
        if layout.COMMIT_SUCCESS_FILE in old:
            storage.remove_file(_join(self.final, layout.COMMIT_SUCCESS_FILE))
            old.remove(layout.COMMIT_SUCCESS_FILE)
        concurrently(storage.remove_file, [_join(self.final, f) for f in old])

    def _refuse_objects_put_since_the_check(
        self, listed: Iterable[str], seen: frozenset[str] | None
    ) -> None:
        """Raises ``CheckpointExistsError`` if ``listed`` (the prefix's objects, as ``create``
        is about to delete them) holds objects the start's check did not list (``seen``, its
        keys): a user's, put there since, at the top or inside a folder. The check found the
        prefix replaceable, not them; no request is made."""
        if seen is None:  # No start check (a target made without one): the listing is it.
            return
        appeared = sorted(set(listed) - seen)
        if not appeared:
            return
        raise errors.CheckpointExistsError(
            f"{self.final} changed after this save checked it ({_shown(appeared)} appeared "
            f"there as the save started): a save never deletes objects that no save wrote, "
            f"even with overwrite=True. Nothing was written or removed (a checkpoint there is "
            f"as it was). Move those objects, or choose another path, then save again."
        )

    def claim(self, *, again: bool = False) -> None:
        """Writes this save's record into the prefix; ``again``: with its heartbeat set to
        now (one GET, one PUT), unless the record is no longer this save's (another save took
        the prefix over, or this one committed: never taken back)."""
        record = self._record
        if again:
            if read_record(self.final) != record:
                return
            record = record.beating()
        storage.write_bytes(_join(self.final, SAVE_RECORD_FILE), record.to_json().encode())

    def publish(
        self, files: Mapping[str, str], marker: str, check: _enclosing.Recheck | None = None
    ) -> None:
        """Writes the files and the checksums of the metadata, checks the prefix is still this
        save's (and ``check``'s parents, in the same round trip), writes the marker."""
        written = {name: text.encode() for name, text in files.items()}
        for name, data in written.items():
            storage.write_bytes(_join(self.final, name), data)
        metadata_checksums.record(self.final, known=written)
        asks = check.requests() if check is not None else []
        # The prefix listed again (one LIST, in the same round trip): what a user put there
        # meanwhile must not end up in the checkpoint (its deletion would delete it).
        listed = functools.partial(storage.list_dir, self.final)
        calls: list[Callable[[], Any]] = [lambda: read_record(self.final), listed, *asks]
        record, listing, *found = concurrently(_call, calls)
        if check is not None:
            check.conclude(found)
        if record != self._record:
            raise errors.CheckpointExistsError(
                f"Another save to {self.final} started while this one was writing, so this one "
                f"was not committed (two saves must not write one path at once). The other "
                f"save's result, if it finishes, is what the path will hold."
            )
        self._refuse_objects_that_appeared(listing, files)
        storage.write_bytes(_join(self.final, layout.COMMIT_SUCCESS_FILE), marker.encode())
        storage.remove_file(_join(self.final, SAVE_RECORD_FILE))

    def discard(self) -> None:
        """Deletes what this save wrote, unless another save has taken the prefix over."""
        # The record is read with the listing, right before deleting (one round trip).
        _leftovers.remove_unfinished(self.final, lambda found: found == self._record)

    def _refuse_objects_that_appeared(
        self, listing: Iterable[storage.Entry], files: Mapping[str, str]
    ) -> None:
        """Raises ``CheckpointExistsError`` if names this save did not write appeared at the
        top of the prefix while it wrote (a user's objects, or another writer's), after
        removing this save's own objects (never theirs): committed, the new checkpoint would
        hold them, and deleting it would delete them. The local rule
        (``RenameTarget._refuse_what_appeared``) on an object store, where the save writes
        in place. Objects put inside the save's own directories are not told from its own;
        what comes between the listing and the marker (one round trip) is not seen."""
        own = _own_top_level(files)
        appeared = sorted({entry.name for entry in listing} - own)
        if not appeared:
            return
        if self.assembled:  # Only what the commit wrote: the partial saves stay.
            mine = [*files, metadata_checksums.CHECKSUMS_FILE]
            removed = "the partial saves were kept (call finalize again)"
        else:
            files_here = storage.list_files(self.final)
            mine = [f for f in files_here if f.split("/")[0] in own and f != SAVE_RECORD_FILE]
            removed = "its objects were removed"
        concurrently(storage.remove_file, [_join(self.final, f) for f in mine])
        storage.remove_file(_join(self.final, SAVE_RECORD_FILE))  # Last: ``discard`` stops.
        replaced = (
            " (the checkpoint this save replaced was deleted as it started: on an object "
            "store an overwrite writes in place)"
            if self.overwrite
            else ""
        )
        raise errors.CheckpointExistsError(
            f"{self.final} changed while this save was writing ({_shown(appeared)} appeared "
            f"there): a save never takes in objects that no save wrote, even with "
            f"overwrite=True. This save was not committed and {removed}; what appeared was "
            f"left as it is{replaced}. Move those objects, then save again."
        )


def _own_top_level(files: Mapping[str, str]) -> frozenset[str]:
    """The top-level names a save writes: its checkpointables (named in the
    ``_CHECKPOINT_METADATA`` among ``files``), ``files``, and a checkpoint's own files."""
    item_handlers = json.loads(files.get(CHECKPOINT_METADATA_FILE, "{}")).get("item_handlers")
    names = set(item_handlers) if isinstance(item_handlers, Mapping) else set()
    return frozenset(names | {n.split("/")[0] for n in files} | _CHECKPOINT_FILES)


def _call(ask: Callable[[], Any]) -> Any:
    return ask()


def _appeared(before: Occupant | None, now: Occupant) -> str:
    """What is at a path now that was not when ``before`` was listed, in words."""
    if now.names is None:
        return "a file"
    earlier = before.names if before is not None and before.names is not None else frozenset()
    new = now.names - earlier
    return _shown(new or now.unexplained() or now.names)


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
            storage.remove_tree(self.path)
        else:
            # Only while the prefix still holds a deletion's record: a save that claimed it
            # since (another process re-saving the step) keeps its objects.
            _leftovers.remove_unfinished(self.path, lambda found: found is None or found.deleting)


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
    record = _leftovers.SaveRecord.new(deleting=True)
    storage.write_bytes(_join(path, SAVE_RECORD_FILE), record.to_json().encode())
    storage.remove_file(_join(path, layout.COMMIT_SUCCESS_FILE))
    return Retired(path)


# -- Reading ----------------------------------------------------------------------------------

Identity = Any  # Comparable: equal identities mean the same committed checkpoint.

# The most a commit marker may hold (ours hold three short lines, Orbax's one): a larger one is
# refused by ``identity`` where it reads the marker (after a ranged GET of one byte on S3).
MAX_MARKER_BYTES = 64 << 10


def identity(path: epath.PathLike) -> Identity:
    """What tells this committed checkpoint from one that replaces it at the same path.

    Local: the directory's inode and its change time (an overwrite swaps in another
    directory; file systems such as ext4 give a deleted directory's inode to the next one
    made, so an overwrite after another could bring the first inode back: the change time,
    which every rename and every new directory sets, tells them apart).
    Object stores: the version of ``commit_success.txt`` where the storage
    tells it (``storage.Versions``: one HEAD, no body), else its contents
    (ours hold the commit time), read up to ``MAX_MARKER_BYTES``. ``None``
    when nothing is committed there (any more).

    Raises:
      cp.errors.IntegrityError: the marker holds more than ``MAX_MARKER_BYTES``.
    """
    text = os.fspath(path)
    if uses_rename(text):
        try:
            stat = os.stat(text)
        except OSError:
            return None
        return (stat.st_dev, stat.st_ino, stat.st_ctime_ns)
    marker = _join(text, layout.COMMIT_SUCCESS_FILE)
    backend = storage.for_path(marker)
    if isinstance(backend, storage.Versions):
        version = backend.version(marker)
        return None if version is None else ("version", version)
    try:
        # Bounded: a load reads the marker twice, and a hostile one may be of many GiB.
        return storage.read_bytes(marker, max_bytes=MAX_MARKER_BYTES)
    except FileNotFoundError:
        return None
    except errors.MetadataError:  # storage.file_too_large
        raise errors.IntegrityError(
            f"{marker} holds more than {MAX_MARKER_BYTES:,} bytes, where a commit marker holds "
            f"a few lines: it was not written by a checkpoint library (damaged or tampered "
            f"with), so {text} cannot be told from a checkpoint that replaces it. Restore the "
            f"checkpoint from a copy, or load an older one."
        ) from None


def check_unchanged(path: epath.PathLike, opened: Identity, error: BaseException | None) -> None:
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


def committed_after_refusal(
    path: epath.PathLike, refusal: errors.NotACheckpointError, *, timeout_secs: float
) -> Identity:
    """The identity of an object-store checkpoint that ``layout.validate_checkpoint_directory``
    refused (``refusal``) for its missing commit marker, if it was committed meanwhile (its
    listing may then show the marker); else raises what a load of it meets.

    Raises:
      cp.errors.CheckpointChangedError: a save with ``overwrite=True`` (or a deletion) is
        replacing the checkpoint (its record says so): load it again once it commits.
      cp.errors.NotACheckpointError: ``refusal``: no save committed there.
    """
    for _ in range(2):  # Again after the record: a save may commit (and drop it) meanwhile.
        now = identity(path)
        if now is not None:
            return now
        record = read_record(path)
        if record is None:
            continue
        if (record.replacing or record.deleting) and not record.is_abandoned(
            timeout_secs=timeout_secs
        ):
            what = "deleted" if record.deleting else "replaced by a save with overwrite=True"
            raise errors.CheckpointChangedError(
                f"The checkpoint at {path} is being {what} ({record.describe()}), so there is "
                f"no checkpoint to read there at the moment. Nothing is damaged: load it again "
                f"once the save commits."
            ) from None
        break
    raise refusal
