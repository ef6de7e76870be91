"""Which run a host's local-tier directory serves, and which process uses it now.

A local step is restored by its number alone, so a directory that held another
run's steps (a second Checkpointer given the same ``LocalTier``, a new run
reusing the directory, another run's files copied in) would be restored in
place of this run's. The first Checkpointer to open a directory records its
persistent root in ``OWNER_FILE``; a Checkpointer of another root is refused,
naming both. A directory without the record (from an earlier version, or a
moved run's whose record was removed) is adopted.

Two processes of a job given one directory would write each other's steps
(their copies have different names, their retention does not know it): the
first process to open a directory holds a lock on ``LOCK_FILE`` (``flock``,
released when it closes or dies), and another process is refused. Checkpointers
of one process share the lock (the root record keeps them to one run).
"""

from __future__ import annotations

import fcntl
import json
import os
import threading

from etils import epath

from checkpointables import errors, storage

__all__ = ["OWNER_FILE", "LOCK_FILE", "claim", "release"]

OWNER_FILE = ".checkpointables-local-tier.json"
LOCK_FILE = ".checkpointables-local-tier.lock"

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
        fd = os.open(os.path.join(real, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
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


def _recorded(path: str) -> str | None:
    try:
        with open(path) as f:
            owner = json.load(f).get("persistent_root")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError) as e:
        raise errors.InvalidArgumentError(
            f"The local tier's record {path} is unreadable ({e}): remove it, and the "
            f"directory's steps, if they are not this run's."
        ) from e
    return owner if isinstance(owner, str) else None


def claim(directory: str, persistent_root: epath.Path) -> None:
    """Records ``persistent_root`` as the owner of the local-tier ``directory``, or checks
    that it is the owner recorded, and takes its lock for this process (``release``
    gives it back).

    Raises:
      cp.errors.InvalidArgumentError: ``directory`` is, or holds, the persistent
        root; it serves the Checkpointer of another root; or another process
        uses it.
    """
    root = _identity(persistent_root)
    if storage.scheme_of(root) is None:
        _refuse_overlap(directory, root)
    _check_owner(directory, root)
    _lock(directory)


def _check_owner(directory: str, root: str) -> None:
    path = os.path.join(directory, OWNER_FILE)
    owner = _recorded(path)
    if owner is None:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"persistent_root": root}, f)
        os.replace(tmp, path)
    elif owner != root:
        raise errors.InvalidArgumentError(
            f"LocalTier({directory!r}) holds the local steps of the Checkpointer of {owner}, "
            f"not of {root}: a local tier serves one run, whose steps it restores by number. "
            f"Give this Checkpointer a directory of its own; if that run is over, remove "
            f"{directory} first; if it is this run, moved to a new root, remove {path}."
        )
