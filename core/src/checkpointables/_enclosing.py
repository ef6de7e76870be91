"""A save never writes inside a finished checkpoint.

``cp.save_pytree("ck/pytree/sub", x)`` after ``ck`` was committed would add a
directory that ``ck``'s save did not write: ``ck``'s ``_CHECKSUMS`` and
``verify`` would then disagree with what it holds, and deleting either one
could be taken for deleting the other. Every save (``_saving``: the free
functions, their async forms) asks twice: when it starts (``problem``, by the
primary host, told to the others in the broadcast that reports the save's other
checks, ``_commit.check_can_save``: no broadcast of its own), and again just
before its commit (``Recheck``), which catches a checkpoint another process
committed at a parent while the save wrote. The training Checkpointer asks
``refuse_inside`` about its root as it opens, and its steps are saves like any
other (both looks). ``cp.partial`` asks ``refuse_inside`` about the user's path
as each partial save and ``finalize`` start, and ``Recheck`` of it just before
each commit: a staged save's rename into the session (local disks; the object
stores' partial saves are saves like any other), and ``finalize``'s own.

What it costs, looking at the parents of the save's path for a finished checkpoint:

- local disks: every parent up to ``/`` (one ``stat`` each, microseconds), after
  resolving symbolic links, so a link into a checkpoint counts too; at the start
  and at the commit;
- object stores: the nearest ``OBJECT_STORE_LEVELS`` parents only, one request
  each (the marker's HEAD; a second, the metadata's, only for a checkpoint
  found). Those levels catch the mistakes that happen (saving into a
  checkpoint, into one of its checkpointable directories, or a folder in one);
  a deeper nesting on an object store is not looked for. At the commit every
  level is asked, issued together with the read-back of the save's record that
  the commit makes anyway: no round trip of its own. At the start, a parent
  found to be no checkpoint by this process's last look (a commit's included)
  is not asked again, so a save usually adds no request there: what this
  remembers may be stale (another process may have committed a checkpoint at
  that parent since), and the commit's look is the one that refuses such a
  save, after it wrote (what it wrote is then removed). A save of this process
  to a path forgets it (it may commit a checkpoint there).

A training root is not a checkpoint (it has no ``_CHECKPOINT_METADATA``, no
commit marker of its own), so the Checkpointer's steps pass; a Checkpointer
whose root lies in a finished checkpoint is refused like any save.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable

from etils import epath

from checkpointables import errors, layout, storage
from checkpointables._asyncio import concurrently

__all__ = [
    "OBJECT_STORE_LEVELS",
    "Recheck",
    "enclosing_checkpoint",
    "forget",
    "problem",
    "refuse_inside",
]

# How many parents of an object-store save are looked at (see the module's docstring).
OBJECT_STORE_LEVELS = 4
# Object-store parents found to be no checkpoint, not asked again at a save's start.
_clear: set[str] = set()
_CLEAR_MAX = 4096  # Then forgotten all at once: a bound on memory, not on correctness.
_clear_lock = threading.Lock()


def _parents(path: epath.PathLike) -> list[str]:
    """The parents of ``path``, nearest first: every one locally (links resolved), the
    nearest ``OBJECT_STORE_LEVELS`` on an object store (down to the bucket); never a
    temporary directory (a save's own)."""
    text = os.fspath(path).rstrip("/")
    if storage.is_local(text):
        current = os.path.realpath(text)
        parents = []
        while os.path.dirname(current) != current:
            current = os.path.dirname(current)
            parents.append(current)
    else:
        scheme, _, rest = text.partition("://")
        parts = rest.split("/")  # bucket, then the key's components
        levels = range(len(parts) - 1, max(len(parts) - 1 - OBJECT_STORE_LEVELS, 0), -1)
        parents = [f"{scheme}://{'/'.join(parts[:n])}" for n in levels]
    return [p for p in parents if not layout.is_temporary_path(p)]


def _remember(asked: list[str], found: list[bool]) -> None:
    """Remembers which object-store parents were found to be no checkpoint (and forgets
    those found to be one)."""
    with _clear_lock:
        if len(_clear) > _CLEAR_MAX:
            _clear.clear()
        for parent, is_one in zip(asked, found, strict=True):
            if is_one:
                _clear.discard(parent)
            else:
                _clear.add(parent)


def enclosing_checkpoint(path: epath.PathLike) -> str | None:
    """The finished checkpoint that ``path`` lies in (see the module's docstring for how far
    up it looks, and what it remembers), or ``None``. ``path`` itself does not count (a
    save's existence check handles it)."""
    parents = _parents(path)
    if storage.is_local(path):  # A stat each: cheaper in turn than handed to threads.
        return next((p for p in parents if layout.is_checkpoint(p)), None)
    with _clear_lock:
        asked = [p for p in parents if p not in _clear]
    found = concurrently(layout.is_checkpoint, asked)
    _remember(asked, found)
    return next((p for p, is_one in zip(asked, found, strict=True) if is_one), None)


def forget(path: epath.PathLike) -> None:
    """A save to ``path`` starts, or commits: a checkpoint may be there, so ask again next
    time."""
    with _clear_lock:
        _clear.discard(os.fspath(path).rstrip("/"))


def refuse_inside(path: epath.PathLike) -> None:
    """Raises ``cp.errors.InvalidArgumentError`` if ``path`` lies in a finished checkpoint
    (this process looks)."""
    forget(path)
    found = problem(path)
    if found:
        raise errors.InvalidArgumentError(found)


def problem(path: epath.PathLike) -> str:
    """Why a save must not write ``path`` (it is inside a finished checkpoint), or ``""``."""
    try:
        enclosing = enclosing_checkpoint(path)
    except errors.StorageError as e:  # It names a parent's marker: say which save asked.
        raise errors.StorageError(f"Saving {path}: {e}") from e
    return "" if enclosing is None else _refusal(path, enclosing)


def _refusal(path: epath.PathLike, enclosing: str, after: str = "") -> str:
    return (
        f"{path} is inside the finished checkpoint {enclosing}{after}: saving there would add "
        f"a directory to that checkpoint (its checksums and `checkpointables verify` would no "
        f"longer match it, and deleting one could delete the other). Save to a path outside "
        f"{enclosing}, e.g. a sibling of it."
    )


class Recheck:
    """The look, just before a save's commit, for a checkpoint committed at a parent of its
    path while it wrote: every parent is asked (nothing remembered is trusted), by requests
    the commit issues together with its own (``requests``, then ``conclude``)."""

    def __init__(self, path: epath.PathLike, outcome: str = "") -> None:
        """``outcome``: what the refusal says became of the save (default: a save's, whose
        files its caller removes)."""
        self.path = path
        self.outcome = outcome or "so this save was not committed and what it wrote was removed"
        self._parents = _parents(path)

    def requests(self) -> list[Callable[[], bool]]:
        """One per parent: whether it is a finished checkpoint."""
        return [functools.partial(self._ask, p) for p in self._parents]

    def _ask(self, parent: str) -> bool:
        try:
            return layout.is_checkpoint(parent)
        except errors.StorageError as e:
            raise errors.StorageError(f"Committing {self.path}: {e}") from e

    def now(self) -> None:
        """Asks ``requests`` one after another (locally a ``stat`` each) and ``conclude``s."""
        self.conclude([ask() for ask in self.requests()])

    def conclude(self, found: list[bool]) -> None:
        """Raises ``cp.errors.InvalidArgumentError`` if the answers to ``requests`` found a
        parent to be a finished checkpoint; remembers them (the next save's start uses them)."""
        if not storage.is_local(self.path):
            _remember(self._parents, found)
        enclosing = next((p for p, is_one in zip(self._parents, found, strict=True) if is_one), "")
        if enclosing:
            after = (
                " (found as this save was about to commit: committed after this save started, "
                f"or after this process last looked; {self.outcome})"
            )
            raise errors.InvalidArgumentError(_refusal(self.path, enclosing, after))
