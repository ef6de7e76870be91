"""Which run a host's local-tier directory serves: the persistent root it was opened with.

A local step is restored by its number alone, so a directory that held another
run's steps (a second Checkpointer given the same ``LocalTier``, a new run
reusing the directory, another run's files copied in) would be restored in
place of this run's. The first Checkpointer to open a directory records its
persistent root in ``OWNER_FILE``; a Checkpointer of another root is refused,
naming both. A directory without the record (from an earlier version, or a
moved run's whose record was removed) is adopted.
"""

from __future__ import annotations

import json
import os

from etils import epath

from checkpointables import errors, storage

__all__ = ["OWNER_FILE", "claim"]

OWNER_FILE = ".checkpointables-local-tier.json"


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
    that it is the owner recorded.

    Raises:
      cp.errors.InvalidArgumentError: ``directory`` is, or holds, the persistent
        root; or it serves the Checkpointer of another root.
    """
    root = _identity(persistent_root)
    if storage.scheme_of(root) is None:
        _refuse_overlap(directory, root)
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
