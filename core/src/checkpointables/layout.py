"""The checkpoint directory: names, validation, temporary paths and the atomic commit.

On a local disk a checkpoint is written under a temporary sibling directory
and renamed into place only after every handler finished and
``_CHECKPOINT_METADATA`` is written and flushed to disk. An interrupted save
therefore leaves at most a directory whose name says it is temporary; it is
never mistaken for a checkpoint and never touches an existing one. On object
stores a checkpoint counts once its ``commit_success.txt`` exists (see
``_commit``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import os
import re
import socket
import sys
import time
import uuid
from collections.abc import Iterable, Mapping

from etils import epath

from checkpointables import errors, metadata_checksums, storage
from checkpointables._asyncio import concurrently
from checkpointables.checkpoint_metadata import CHECKPOINT_METADATA_FILE
from checkpointables.metadata_checksums import CHECKSUMS_FILE
from checkpointables.path._parse import as_path

__all__ = [
    "MARKER_FILE",
    "COMMIT_SUCCESS_FILE",
    "RESERVED_NAMES",
    "METRICS_NAME",
    "validate_checkpointable_name",
    "is_temporary_path",
    "parse_temporary_name",
    "temporary_path_for",
    "validate_checkpoint_directory",
    "is_checkpoint",
    "where_instead",
    "fsync_tree",
    "rename_durably",
    "commit",
]

MARKER_FILE = "orbax.checkpoint"
COMMIT_SUCCESS_FILE = "commit_success.txt"
TMP_INFIX = ".checkpointables-tmp-"
OLD_INFIX = ".checkpointables-old-"
# Where cp.partial's saves wait for finalize (its SESSION_SUFFIX; partial imports this module).
PARTIAL_SESSION_SUFFIX = ".partial_save"
_FOREIGN_TMP_MARKERS = (".orbax-checkpoint-tmp", PARTIAL_SESSION_SUFFIX)
# A step's metrics (written by the training Checkpointer, and by Orbax's), not a checkpointable.
METRICS_NAME = "metrics"
RESERVED_NAMES = frozenset(
    {
        METRICS_NAME,
        "AUTO",
        CHECKPOINT_METADATA_FILE,
        CHECKSUMS_FILE,
        MARKER_FILE,
        COMMIT_SUCCESS_FILE,
        "descriptor",
    }
)
_TMP_PATTERN = re.compile(r"\.checkpointables-(tmp|old)-(\d+)-(\d+)-([0-9a-f]+)$")
# A partial save (cp.partial) is an ordinary checkpoint at ``<session>/pytree/partial-<seq>``
# (partial's SOURCE_PREFIX), kept at ``<path>/pytree/partial-<seq>`` once finalized.
_PARTIAL_PIECE = re.compile(r"partial-[0-9]+")
_PARTIAL_PIECE_PARENT = "pytree"


def validate_checkpointable_name(name: object) -> str:
    """Returns ``name`` if it can name a subdirectory; raises ``ValueError`` otherwise."""
    if not isinstance(name, str):
        raise errors.InvalidArgumentError(f"Checkpointable names must be strings, got {name!r}.")
    if not name:
        raise errors.InvalidArgumentError("Checkpointable names must not be empty.")
    if "/" in name or "\\" in name or name in (".", "..") or ".." in name or "\0" in name:
        raise errors.InvalidArgumentError(
            f"Checkpointable name {name!r} is not a plain directory name: it must not contain "
            f"'/', '\\', '..' or NUL. Choose a name like 'params' or 'dataset'."
        )
    if name in RESERVED_NAMES or name.startswith("."):
        raise errors.InvalidArgumentError(
            f"Checkpointable name {name!r} is reserved (reserved: {sorted(RESERVED_NAMES)} and "
            f"names starting with '.'). Choose another name."
        )
    return name


def validate_checkpointables_dict(checkpointables: object) -> Mapping[str, object]:
    """Checks the argument of ``save_checkpointables`` before anything is written."""
    if not isinstance(checkpointables, Mapping):
        raise errors.InvalidArgumentError(
            f"save_checkpointables takes a dict of name to checkpointable, got "
            f"{type(checkpointables).__name__}. To save one pytree use save_pytree: "
            f"cp.save_pytree(path, pytree), or on a Checkpointer ckptr.save_pytree(step, pytree)."
        )
    if not checkpointables:
        raise errors.InvalidArgumentError(
            "save_checkpointables got an empty dict; there is nothing to save."
        )
    for name in checkpointables:
        validate_checkpointable_name(name)
    return checkpointables


def is_temporary_path(path: epath.PathLike) -> bool:
    """Whether ``path`` is an unfinished save's directory (ours or Orbax's)."""
    name = os.path.basename(os.fspath(path).rstrip("/"))
    return TMP_INFIX in name or OLD_INFIX in name or any(m in name for m in _FOREIGN_TMP_MARKERS)


def temporary_path_for(final: epath.Path, infix: str = TMP_INFIX) -> epath.Path:
    """A fresh sibling of ``final`` named so nobody mistakes it for a checkpoint.

    The name records the creation time, the process id and the host (its tag), so a later
    cleanup can tell abandoned directories from ones still being written (``_leftovers``).
    """
    unique = f"{host_tag()}{uuid.uuid4().hex[:4]}"
    return final.parent / f"{final.name}{infix}{time.time_ns()}-{os.getpid()}-{unique}"


# A temporary name's last field: ``<host tag><4 random>`` hex digits (the name stays within
# ``_user_paths.TEMPORARY_SUFFIX_BYTES``; the time and pid already tell names apart). Older
# versions wrote 8 random ones: such a name tells neither its host nor that its save
# refreshes a heartbeat (``_leftovers``).
HOST_TAG_HEX = 10


@functools.cache
def host_tag(host: str | None = None) -> str:
    """The tag of ``host`` (default: this machine) in temporary names: a hash of its name."""
    name = socket.gethostname() if host is None else host
    return hashlib.sha256(name.encode()).hexdigest()[:HOST_TAG_HEX]


def temporary_name_host_tag(name: str) -> str | None:
    """The host tag of temporary name ``name``; ``None`` for older names (and others')."""
    match = _TMP_PATTERN.search(name)
    if match is None or len(match.group(4)) != HOST_TAG_HEX + 4:
        return None
    return match.group(4)[:HOST_TAG_HEX]


def parse_temporary_name(name: str) -> tuple[str, int, int] | None:
    """``(final name, creation time ns, pid)`` for our temporary names, else ``None``."""
    match = _TMP_PATTERN.search(name)
    if match is None:
        return None
    return name[: match.start()], int(match.group(2)), int(match.group(3))


def _commit_file(path: str) -> str:
    """The file whose presence makes ``path`` a committed checkpoint.

    Locally a checkpoint appears whole by a rename, so its metadata file says it
    is one (Orbax's local checkpoints have no other marker); on an object store
    only the marker written last does.
    """
    name = CHECKPOINT_METADATA_FILE if storage.is_local(path) else COMMIT_SUCCESS_FILE
    return f"{path.rstrip('/')}/{name}"


def _metadata_file(path: str) -> str:
    return f"{path.rstrip('/')}/{CHECKPOINT_METADATA_FILE}"


def _refuse_irregular_marker(marker: str) -> None:
    try:
        problem = storage.not_a_regular_file(marker, os.stat(marker).st_mode)
    except OSError:
        return  # A dangling link: the file is missing, as the caller says.
    raise errors.NotACheckpointError(f"Not a checkpoint this library reads: {problem}")


def _local_non_directory(text: str) -> bool:
    """Whether a local ``text`` is something other than a directory (a pipe, a device)."""
    return storage.is_local(text) and os.path.exists(text) and not os.path.isdir(text)


def _unpublished_partial_saves(text: str) -> str:
    """What a missing local ``text`` awaits, where ``cp.partial`` saved to it without a
    ``finalize`` ("" if nothing)."""
    session = text.rstrip("/") + PARTIAL_SESSION_SUFFIX
    if not (storage.is_local(text) and os.path.isdir(session)):
        return ""
    return (
        f" But {session} exists: it holds partial saves (cp.partial.save) of this path, which "
        f"appear here only once published: call cp.partial.finalize({text!r}), then load it."
    )


def partial_piece_of(path: epath.PathLike) -> tuple[str, str] | None:
    """``(where it is kept, the checkpoint to load instead)`` if ``path`` is one partial save
    of ``cp.partial`` (``<session>/pytree/partial-<seq>``, or the same inside the checkpoint
    ``finalize`` published), else ``None``.

    Such a save is a checkpoint on disk but holds only that call's keys: reading it
    alone would look like the whole checkpoint. Cheap: names only, and when they fit a
    look at the grandparent (a stat; on an object store, where the session is the path
    itself, one HEAD: only a finished checkpoint there tells a piece from a checkpoint
    a user saved under such a name, so an unfinished session's piece is not told).
    """
    text = os.fspath(path).rstrip("/")
    parent, _, name = text.rpartition("/")
    if not _PARTIAL_PIECE.fullmatch(name) or parent.rpartition("/")[2] != _PARTIAL_PIECE_PARENT:
        return None
    holder = parent.rpartition("/")[0]
    if not holder:
        return None
    if holder.endswith(PARTIAL_SESSION_SUFFIX):
        return holder, holder.removesuffix(PARTIAL_SESSION_SUFFIX)
    if storage.is_file(_commit_file(holder)):
        return holder, holder
    return None


def refuse_partial_piece(path: epath.PathLike) -> None:
    """Raises ``NotACheckpointError`` if ``path`` is one partial save of ``cp.partial``
    (``partial_piece_of``), saying what to load instead; names only unless they fit."""
    piece = partial_piece_of(path)
    if piece is None:
        return
    holder, final = piece
    published = holder == final and is_checkpoint(final)
    advice = (
        f"load {final}, the checkpoint finalize published from all of them"
        if published
        else f"load {final} after cp.partial.finalize({final!r}) published it"
    )
    raise errors.NotACheckpointError(
        f"{path} is a piece of a partial save (one cp.partial.save call, kept in {holder}), not "
        f"a checkpoint of its own: it holds only that call's keys. To read the checkpoint, "
        f"{advice}."
    )


def _listed(store: storage.Storage, path: str) -> list[storage.Entry]:
    """``store.list_dir(path)``; a path that goes through a symbolic link the system cannot
    follow (a loop) is ``CheckpointNotFoundError`` naming the link: nothing is there."""
    try:
        return store.list_dir(path)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        link = storage.unfollowable_link(path)
        raise errors.CheckpointNotFoundError(
            f"No checkpoint at {path}: {link} is a symbolic link that leads back to itself (a "
            f"loop) or through more links than the system follows, so nothing is reached "
            f"through it. Fix or remove the link, or pass another path."
        ) from None


def validate_checkpoint_directory(path: epath.Path, command: str | None = None) -> None:
    """Raises unless ``path`` is a finished checkpoint.

    Where ``path`` holds, or is inside, a checkpoint the message names it
    (:func:`where_instead`): as the API loads it, or, given ``command``, as
    that ``checkpointables`` subcommand is run on it.

    Raises:
      FileNotFoundError: nothing exists at ``path`` (``errors.CheckpointNotFoundError``;
        also where a symbolic link on it loops, naming that link).
      errors.NotACheckpointError: ``path`` is a file, a temporary directory, one
        partial save of ``cp.partial`` (``partial_piece_of``), or has no
        ``_CHECKPOINT_METADATA`` (on an object store: no commit marker).
    """
    text = os.fspath(path)
    if text.rstrip("/").endswith(PARTIAL_SESSION_SUFFIX):
        final = text.rstrip("/").removesuffix(PARTIAL_SESSION_SUFFIX)
        raise errors.NotACheckpointError(
            f"{path} holds partial saves (cp.partial.save) that were not published yet; it is "
            f"not a checkpoint. Publish them with cp.partial.finalize({final!r}), then load "
            f"{final}."
        )
    refuse_partial_piece(text)
    if is_temporary_path(text):
        raise errors.NotACheckpointError(
            f"{path} is the temporary directory of a save that did not finish; it is not a "
            f"checkpoint. Load the final path instead, or delete it."
        )
    store = storage.for_path(text)
    if store.is_file(_commit_file(text)):
        return  # The usual case, checked with one stat (or request); else the full story.
    names = sorted(e.name for e in _listed(store, text))
    if not names and (store.is_file(text) or _local_non_directory(text)):
        raise errors.NotACheckpointError(f"{path} is a file, not a checkpoint directory.")
    if not names and not (storage.is_local(text) and os.path.isdir(text)):
        raise errors.CheckpointNotFoundError(
            f"No checkpoint at {path}: the path does not exist (nothing is stored there)."
            + _unpublished_partial_saves(text)
        )
    if os.path.basename(_commit_file(text)) in names and storage.is_local(text):
        _refuse_irregular_marker(_commit_file(text))  # There, but not as a regular file.
    if CHECKSUMS_FILE in names and CHECKPOINT_METADATA_FILE not in names:
        _refuse_lost_metadata(text)
    hint = where_instead(text, command, names)  # The error path only: a few stats more.
    raise errors.NotACheckpointError(
        f"{path} is not a finished checkpoint: it has no {os.path.basename(_commit_file(text))} "
        f"({f'it holds {names[:8]}' if names else 'the directory is empty'}), so a save to it "
        f"did not finish (or is still running), or it is not a checkpoint.{hint and ' '}{hint}"
    )


def _refuse_lost_metadata(directory: str) -> None:
    """Raises ``IntegrityError`` if the ``_CHECKSUMS`` in ``directory`` records the missing
    ``_CHECKPOINT_METADATA``: a committed checkpoint that lost it is damaged, not a save
    that did not finish (docs/integrity.md, "A checkpoint that lost its metadata")."""
    with contextlib.suppress(FileNotFoundError):  # Not recorded: the generic refusal.
        metadata_checksums.read_file(
            f"{directory.rstrip('/')}/{CHECKPOINT_METADATA_FILE}",
            max_bytes=metadata_checksums.MAX_FILE_BYTES,
        )


def is_checkpoint(path: epath.PathLike) -> bool:
    """Whether ``path`` is a finished checkpoint (ours, or Orbax's V1 or V0): one a load
    opens rather than refusing with ``cp.errors.NotACheckpointError``.

    Local: whether it has its ``_CHECKPOINT_METADATA`` (one stat). On an
    object store: whether it has its commit marker and ``_CHECKPOINT_METADATA``
    (two requests for a checkpoint; one for anything else). A marker alone, or
    a prefix missing its metadata, is not a checkpoint: no save of ours or
    Orbax's commits without it, and a load could not read it.
    Nor is one partial save of ``cp.partial`` (``partial_piece_of``), before or
    after ``finalize``: it holds only some of the checkpoint's keys.

    Raises:
      cp.errors.StorageError: the object store cannot be reached or refuses the
        request (no network, no credentials, a bucket that does not exist): the
        answer is unknown, and a ``False`` would send a training job back to step 0.
    """
    path = as_path(path)  # A scheme nothing reaches: cp.errors.UnsupportedPathError.
    text = os.fspath(path)
    try:
        if is_temporary_path(text) or not storage.is_file(_commit_file(text)):
            return False
        if partial_piece_of(text) is not None:  # Rare: only then a stat more.
            return False
        # Locally the commit file is the metadata; on an object store a load reads it next.
        return storage.is_local(text) or storage.is_file(_metadata_file(text))
    except errors.StorageError:
        raise
    except OSError:
        return False


# -- Where to look instead of a path that is not a checkpoint --------------------------------

_LOCAL_COPY = re.compile(
    r"p[0-9]+-of-([0-9]+)"
)  # A local tier's copy of a step: docs/local-tier.md.
_HINT_LOOKS = 20  # Children looked at (newest first) for a step: one stat, or request, each.
_HOLDER_SHOWN = 3  # Checkpoints named when a directory holds several.
# A step's directory name: ``[<prefix>_]<digits>`` (cp.training's standard step name format).
_STEP_NAME = re.compile(r"(?:.+_)?[0-9]+")
_HINT_DEPTH = 3  # Ancestors looked at: <checkpoint>/<checkpointable>/<folder>/<folder>.


def natural_key(text: str) -> tuple[str | int, ...]:
    """Sorts ``text`` with its runs of digits compared as numbers: ``layer_2`` before
    ``layer_10``, step ``9`` before ``10``."""
    parts = re.split(r"(\d+)", text)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts))


def _join(path: str, name: str) -> str:
    return f"{path.rstrip('/')}/{name}" if "://" in path else os.path.join(path, name)


def where_instead(
    path: epath.PathLike, command: str | None = None, names: Iterable[str] | None = None
) -> str:
    """Which checkpoint to give instead of ``path``, which is not one, when it is inside a
    checkpoint (a checkpointable's folder), a local tier's step or directory, or a root of
    a Checkpointer's steps; "" when it is none of these.

    ``command``: the ``checkpointables`` subcommand the advice runs; ``None``: the API's
    load functions. ``names``: the children of ``path``, if already listed. For error
    messages only: it costs a stat (a request, on an object store) per ancestor and
    child looked at, and a listing per child that is not a checkpoint (20 at most).
    """
    text = os.fspath(path)
    try:
        parent = _enclosing_checkpoint(text)
        if parent is not None:
            return _inside_hint(text, parent, command)
        if names is None:
            names = [e.name for e in storage.list_dir(text)]
        return _holder_hint(text, sorted(names, key=natural_key, reverse=True), command)
    except (OSError, ValueError):  # Library errors are ValueErrors or OSErrors.
        return ""  # The hint is a courtesy: the message stands without it.


def _enclosing_checkpoint(path: str) -> str | None:
    """The checkpoint ``path`` is inside, a few levels up at most."""
    parent = path.rstrip("/")
    for _ in range(_HINT_DEPTH):
        parent = parent.rpartition("/")[0] if "://" in parent else os.path.dirname(parent)
        if not parent or parent.endswith(":/"):
            return None
        if is_checkpoint(parent):
            return parent
    return None


def _inside_hint(path: str, parent: str, command: str | None) -> str:
    if command is not None:
        return (
            f"It is inside the checkpoint {parent} ({command} shows each of its "
            f"checkpointables): run `checkpointables {command} {parent}`."
        )
    relative = path.rstrip("/")[len(parent) :].strip("/\\")
    name = re.split(r"[/\\]", relative)[0]
    return (
        f"It is inside the checkpoint {parent}, in its checkpointable {name!r}: give the "
        f"checkpoint's path instead: cp.load_pytree({parent!r}, checkpointable_name={name!r}) "
        f"loads this checkpointable, cp.load_checkpointables({parent!r}) all of them."
    )


def _holder_hint(path: str, names: list[str], command: str | None) -> str:
    """The hint for ``path`` holding checkpoints: its ``names``, newest first."""
    copies = [_join(path, n) for n in reversed(names) if _LOCAL_COPY.fullmatch(n)]
    copies = [c for c in copies if is_checkpoint(c)]
    if copies:
        where = f"each host's copy of it is a checkpoint, here {', '.join(copies)}"
        if command is not None:
            return (
                f"It is a step of a local tier (docs/local-tier.md): {where}. Run "
                f"`checkpointables {command} {copies[0]}`."
            )
        return f"It is a step of a local tier (docs/local-tier.md): {where}. " + _local_advice(
            copies[0],
            "Restore the step with the Checkpointer whose local_tier saved it "
            "(ckptr.load_pytree(step))",
        )
    for i, name in enumerate(names[:_HINT_LOOKS]):
        step = _join(path, name)
        if is_checkpoint(step):
            return _root_hint(path, step, names[i + 1 : _HINT_LOOKS], command)
        nested = _local_copies(step)
        if nested:
            text = (
                f"It is a local tier's directory (docs/local-tier.md): each host's copy of a "
                f"step is a checkpoint; the newest here is {nested[0]}"
            )
            if command is not None:
                return f"{text}: `checkpointables {command} {nested[0]}`."
            return f"{text}. " + _local_advice(
                nested[0],
                "Restore its newest step with the Checkpointer whose local_tier it is "
                "(ckptr.load_pytree())",
            )
    return ""


def is_step_name(name: str) -> bool:
    """Whether ``name`` is a name a Checkpointer gives a step: an integer, or the standard
    step name format's ``<prefix>_<integer>``."""
    return _STEP_NAME.fullmatch(name) is not None


def checkpoints_holder(names: Iterable[str]) -> str:
    """What a directory holding the checkpoints ``names`` is, for a message: a
    Checkpointer's root "with steps ..." only if every name is a step's name, else "a
    directory holding checkpoints ...". Example: ``checkpoints_holder(["nx_orbax"])``."""
    names = list(names)
    shown = ", ".join(names[:_HOLDER_SHOWN]) + (", ..." if len(names) > _HOLDER_SHOWN else "")
    if names and all(is_step_name(n) for n in names):
        return f"a Checkpointer's root (or a directory of checkpoints) with steps {shown}"
    return f"a directory holding checkpoints {shown}"


def _root_hint(path: str, step: str, rest: list[str], command: str | None) -> str:
    """The hint for ``path`` holding checkpoints: ``step``, the newest, and others among
    ``rest`` (names newest first; only a few looked at)."""
    name = os.path.basename(step.rstrip("/"))
    if not is_step_name(name):
        others = [n for n in rest[: _HOLDER_SHOWN - 1] if is_checkpoint(_join(path, n))]
        where = f"It is {checkpoints_holder([name, *others])}, not a checkpoint itself"
        if command is not None:
            return f"{where}: {command} one of them: `checkpointables {command} {step}`."
        return f"{where}: load one of them, e.g. cp.load_pytree({step!r})."
    if command is not None:
        return (
            f"It is a root of several checkpoints (a Checkpointer's steps): {command} one of "
            f"its steps; the newest is {step}: `checkpointables {command} {step}`."
        )
    return (
        f"It is a root of several checkpoints (a Checkpointer's steps): load one of its steps; "
        f"the newest is {step}: cp.load_pytree({step!r}), or "
        f"cp.training.Checkpointer({path!r}).load_pytree() for the newest."
    )


def _local_advice(copy: str, restore: str) -> str:
    """How the API restores a local tier's step of which ``copy`` is a host's copy:
    ``restore`` (with the Checkpointer), or a load of ``copy`` alone."""
    one_process = _LOCAL_COPY.fullmatch(os.path.basename(copy.rstrip("/")))
    whole = one_process is not None and one_process.group(1) == "1"
    return f"{restore}, which gathers every host's shards; " + (
        f"or load the copy, cp.load_pytree({copy!r}): one process saved it, so it holds "
        f"every shard."
        if whole
        else f"a copy loaded alone, cp.load_pytree({copy!r}), holds its process's shards only."
    )


def _local_copies(step: str) -> list[str]:
    """The local tier's committed copies in ``step``, lowest process first."""
    try:
        names = [e.name for e in storage.list_dir(step) if _LOCAL_COPY.fullmatch(e.name)]
    except (OSError, ValueError):  # A file, say.
        return []
    copies = [_join(step, n) for n in sorted(names, key=natural_key)]
    return [c for c in copies if is_checkpoint(c)]


def checkpointable_directories(path: epath.Path, recorded: Iterable[str]) -> list[str]:
    """Names of the checkpointables stored in checkpoint ``path``, sorted."""
    directories = {e.name for e in storage.list_dir(path) if e.is_dir}
    names = {n for n in recorded if n in directories}
    names.update(n for n in directories if n not in RESERVED_NAMES and not n.startswith("."))
    return sorted(names)


# -- Durable local operations -------------------------------------------------------------


def _fsync(path: str, directory: bool) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: epath.Path) -> None:
    """Flushes every file and directory under ``root`` to disk, but files with several
    hard links.

    Handlers should flush what they write; this makes the commit safe even for
    handlers that do not. Flushing an already clean file is cheap. The flushes
    run concurrently: the file system then commits them in a few journal
    transactions instead of one each (2.5x faster for a small checkpoint here).

    A file with several links was linked from a committed checkpoint (an
    incremental save's reused data), which flushed it when it committed; its
    new name is flushed with its directory. A reusing save's commit flushed its
    224 linked files and the rest in 10 ms here, the rest alone in 3.5 ms (a new
    link leaves the file's inode to be journalled). A handler that links a file
    it wrote itself must flush that file.
    """
    targets: list[tuple[str, bool]] = []
    _flush_targets(os.fspath(root), targets)
    # Files and directories at once: each must be on disk before the commit's rename, in
    # no particular order, and flushes issued together share journal commits. In slices, one
    # per worker: a task per file cost more than flushing it (225 files: 7 ms against 3.7).
    slices = [targets[i::_FSYNC_WORKERS] for i in range(min(_FSYNC_WORKERS, len(targets)))]
    concurrently(_fsync_all, slices)


_FSYNC_WORKERS = 16  # ``concurrently``'s threads.


def _flush_targets(directory: str, targets: list[tuple[str, bool]]) -> None:
    """Appends what ``fsync_tree`` flushes under ``directory``, the directory last."""
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                _flush_targets(entry.path, targets)
            elif entry.stat(follow_symlinks=False).st_nlink == 1:
                targets.append((entry.path, False))
    targets.append((directory, True))


def _fsync_all(targets: list[tuple[str, bool]]) -> None:
    for path, directory in targets:
        _fsync(path, directory)


def rename_durably(source: epath.PathLike, target: epath.PathLike) -> None:
    """Renames ``source`` to ``target`` and flushes the rename to disk."""
    os.rename(os.fspath(source), os.fspath(target))
    _fsync(os.path.dirname(os.fspath(target)) or ".", directory=True)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Atomically swaps two paths (Linux ``renameat2``); False where unsupported."""
    if sys.platform != "linux":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    result = renameat2(_AT_FDCWD, a.encode(), _AT_FDCWD, b.encode(), _RENAME_EXCHANGE)
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False  # The file system cannot swap: fall back to two renames.
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def commit(tmp: epath.Path, final: epath.Path, *, overwrite: bool) -> None:
    """Atomically publishes ``tmp`` as ``final``.

    With ``overwrite``, the new and old directories are swapped in one atomic
    step where the file system allows it (the old one then sits at ``tmp``'s
    temporary name and is deleted). Elsewhere the old one is first renamed
    aside under a ``.checkpointables-old-`` name, so that a crash between the
    two renames leaves it whole and recognizable.
    """
    aside: epath.Path | None = None
    if os.path.lexists(os.fspath(final)):
        if not overwrite:
            raise errors.CheckpointExistsError(
                f"{final} appeared while the save was running (another save committed it first), "
                f"so this save was not committed and its files were discarded. Pass "
                f"overwrite=True to replace it, or save to another path."
            )
        if _exchange(os.fspath(tmp), os.fspath(final)):
            _fsync(os.fspath(final.parent), directory=True)
            storage.remove_tree(tmp)
            return
        aside = temporary_path_for(final, OLD_INFIX)
        os.rename(os.fspath(final), os.fspath(aside))
    rename_durably(tmp, final)
    if aside is not None:
        storage.remove_tree(aside)
