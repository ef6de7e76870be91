"""Which run a host's local-tier directory serves, and which process uses it now.

A local step is restored by its number alone, so a directory that held another
run's steps (a second Checkpointer given the same ``LocalTier``, a new run
reusing the directory, another run's files copied in) would be restored in
place of this run's. The first Checkpointer to open a directory records its
persistent root in ``OWNER_FILE``; a Checkpointer of another root is refused,
naming both. A directory without the record (from an earlier version, or a
moved run's whose record was removed) is adopted: the runs its copies'
manifests name are recorded too (``adopted_runs``). Each copy's manifest
names its run (``Manifest.run``), and a copy of any other run (another run's
step directory copied in) is passed over (``Store.copies``).

A directory without the record is claimed only if it holds nothing but what
the tier writes (``_unclaimable``): its record and lock, steps it wrote
(``_store.foreign``), and ``lost+found`` (a file system's own). One holding
anything else (a checkpoint root, Orbax's or ours, free-function checkpoints
saved as ``<dir>/<n>``, a user's files) is refused: the tier's retention
removes the numbered steps it does not keep, and its directory is its own.

Two processes of a job given one directory would write each other's steps
(their copies have different names, their retention does not know it): the
first process to open a directory holds a lock on ``LOCK_FILE`` (``flock``,
released when it closes or dies), and another process is refused. Checkpointers
of one process share the lock (the root record keeps them to one run).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import threading

from etils import epath

from checkpointables import errors, layout, storage
from checkpointables.training.local_tier import _manifest, _store

__all__ = ["OWNER_FILE", "LOCK_FILE", "claim", "release"]

OWNER_FILE = ".checkpointables-local-tier.json"
LOCK_FILE = ".checkpointables-local-tier.lock"
_MAX_RECORD_BYTES = 1 << 20  # A record names a few roots: a larger one is not a record.

# The directories this process holds the lock of: real path -> [its descriptor, users].
_held: dict[str, list[int]] = {}
_held_lock = threading.Lock()


def _lock(directory: str) -> None:
    """Takes (or shares, within this process) the lock of ``directory``."""
    real = os.path.realpath(directory)
    with _held_lock:
        if real in _held:
            _held[real][1] += 1
            return
        fd = _open_lock(os.path.join(real, LOCK_FILE))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise errors.InvalidArgumentError(
                f"LocalTier({directory!r}) is in use by another process on this host: each "
                f"process of a job needs a local directory of its own (e.g. one named after "
                f"jax.process_index()). If no such process runs, its lock was left on a "
                f"network file system: give the tier a directory on the host's own disk."
            ) from None
        _held[real] = [fd, 1]


def _open_lock(path: str) -> int:
    """A descriptor of the lock file at ``path`` (created if missing).

    Raises:
      cp.errors.InvalidArgumentError: what is there is no regular file (a directory, a
        named pipe, a symbolic link, which is not followed), or cannot be opened.
    """
    # O_NOFOLLOW: a link would make (and lock) a file elsewhere; O_NONBLOCK: a pipe.
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        why = e.strerror
    else:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        os.close(fd)
        why = "not a regular file"
    if os.path.islink(path):
        why = "a symbolic link"
    raise errors.InvalidArgumentError(
        f"The local tier's lock file {path} cannot be used: {why}. It must be a regular "
        f"file the tier creates: remove what is there (no process using the directory "
        f"holds it then), or give the tier another directory."
    )


def release(directory: str) -> None:
    """Gives back this process's share of the lock of ``directory`` (see ``claim``)."""
    real = os.path.realpath(directory)
    with _held_lock:
        held = _held.get(real)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _held[real]
            os.close(held[0])  # Closing the descriptor releases the lock.


def _identity(root: epath.Path) -> str:
    """The persistent root as compared: a URL as given, a local path resolved."""
    text = os.fspath(root)
    if storage.scheme_of(text) is not None:
        return text.rstrip("/")
    return os.path.realpath(text)


def _refuse_overlap(directory: str, root: str) -> None:
    local = os.path.realpath(directory)
    if root == local or root.startswith(local + os.sep):
        raise errors.InvalidArgumentError(
            f"LocalTier({directory!r}) is, or holds, the Checkpointer's root {root}: the local "
            f"tier removes the steps it does not keep there. Give it a directory of its own, "
            f"outside the root (on the host's own disk or RAM disk)."
        )


def _recorded(path: str) -> tuple[str | None, frozenset[str]]:
    """The root the record names (``None``: no record), and the runs it adopted."""
    try:
        # Bounded, and refused without a read if no regular file (a pipe would block).
        record = json.loads(storage.read_bytes(path, max_bytes=_MAX_RECORD_BYTES))
        owner, adopted = record.get("persistent_root"), record.get("adopted_runs", [])
    except FileNotFoundError:
        return None, frozenset()
    # MetadataError (larger than the bound) is a ValueError; IntegrityError: a pipe, a
    # device, a directory.
    except (OSError, ValueError, AttributeError, errors.IntegrityError) as e:
        raise errors.InvalidArgumentError(
            f"The local tier's record {path} is unreadable ({e}): remove it, and the "
            f"directory's steps, if they are not this run's."
        ) from e
    runs = frozenset(r for r in adopted if isinstance(r, str)) if isinstance(adopted, list) else ()
    return (owner if isinstance(owner, str) else None), frozenset(runs)


def _runs_present(directory: str, steps: list[str]) -> list[str]:
    """The runs the valid manifests of ``steps`` (the tier's step directories in
    ``directory``) name: the steps a new record adopts."""
    found = set()
    for step in steps:
        try:
            names = os.listdir(os.path.join(directory, step))
        except OSError:
            continue  # Gone since.
        for name in names:
            if name.endswith(_manifest.SUFFIX):
                try:
                    manifest = _manifest.read(os.path.join(directory, step, name))
                except _manifest.InvalidManifest:
                    continue  # Passed over (and logged) when the copies are listed.
                if manifest is not None:
                    found.add(manifest.run)
    return sorted(found)


def _is_own(name: str) -> bool:
    """Whether a top-level ``name`` is the tier's (its record, lock, a record being
    written, a step being removed) or a file system's (``lost+found``)."""
    tmp = f"{OWNER_FILE}.tmp-"
    return (
        name in (OWNER_FILE, LOCK_FILE, "lost+found")
        or (name.startswith(tmp) and name[len(tmp) :].isdigit())
        or _store.is_trash(name)
    )


def _unclaimable(directory: str) -> tuple[list[str], list[str]]:
    """(what in ``directory`` the tier did not write, described; its own steps)."""
    foreign, steps = [], []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.isascii() and name.isdigit():
            why = _store.foreign(path)
            if why is None:
                steps.append(name)
                continue
            if why.startswith("a directory") and layout.is_checkpoint(path):
                why = "a committed checkpoint"
            foreign.append(f"{name} ({why})")
        elif not _is_own(name):
            foreign.append(name)
    return foreign, steps


def _refuse_foreign(directory: str, foreign: list[str]) -> None:
    more = f", and {len(foreign) - 5} more" if len(foreign) > 5 else ""
    raise errors.InvalidArgumentError(
        f"LocalTier({directory!r}) holds what the local tier did not write: "
        f"{'; '.join(foreign[:5])}{more}. The tier removes the numbered steps it does not "
        f"keep from its directory, so it takes only an empty directory or one it used "
        f"before: pick an empty or dedicated directory (e.g. a new one on the host's "
        f"own disk), or move these out of it."
    )


def claim(directory: str, persistent_root: epath.Path) -> tuple[str, frozenset[str]]:
    """Records ``persistent_root`` as the owner of the local-tier ``directory``, or checks
    that it is the owner recorded, and takes its lock for this process (``release``
    gives it back). Returns the run (the root as recorded, which this run's manifests
    name) and the runs adopted with the directory (whose copies it uses too).

    Raises:
      cp.errors.InvalidArgumentError: ``directory`` is, or holds, the persistent
        root; it serves the Checkpointer of another root; it has no record and
        holds what the tier did not write (a checkpoint, a user's file); its
        record or lock file is unusable; or another process uses it.
    """
    root = _identity(persistent_root)
    if storage.scheme_of(root) is None:
        _refuse_overlap(directory, root)
    adopted = _check_owner(directory, root)
    _lock(directory)
    return root, adopted


def _check_owner(directory: str, root: str) -> frozenset[str]:
    path = os.path.join(directory, OWNER_FILE)
    owner, adopted = _recorded(path)
    if owner is None:
        foreign, steps = _unclaimable(directory)
        if foreign:
            _refuse_foreign(directory, foreign)
        runs = [r for r in _runs_present(directory, steps) if r != root]
        tmp = f"{path}.tmp-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)  # A killed claim's (or anything else): never written into.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump({"persistent_root": root, "adopted_runs": runs}, f)
        os.replace(tmp, path)
        return frozenset(runs)
    if owner != root:
        raise errors.InvalidArgumentError(
            f"LocalTier({directory!r}) holds the local steps of the Checkpointer of {owner}, "
            f"not of {root}: a local tier serves one run, whose steps it restores by number. "
            f"Give this Checkpointer a directory of its own; if that run is over, remove "
            f"{directory} first; if it is this run, moved to a new root, remove {path}."
        )
    return adopted
