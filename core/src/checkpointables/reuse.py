"""Incremental saves: what a save may take from an earlier checkpoint instead of writing it.

``cp.save_pytree(path, tree, reuse_from=earlier)`` (and ``save_checkpointables``,
the async forms, and ``cp.training.Checkpointer(reuse_unchanged=True)``) hands
every handler of the save a ``SaveReuse`` for the duration of its blocking
phase: ``current()``. A handler that can reuse data (the pytree plugin) reads
it there, takes from ``source_of(name)`` what did not change, and counts the
bytes it did not write with ``add_reused``. A handler that cannot ignores it:
reuse is an optimization, never a change of what a checkpoint holds.

A ``SaveReuse`` without a source (the first save of a Checkpointer that reuses)
asks handlers to record what the next save needs to compare (the pytree
plugin's fingerprints) without reusing anything.

Guide: ``docs/incremental.md``.

Example (a handler's blocking phase)::

    reuse = cp.reuse.current()
    if reuse is not None and reuse.source is not None:
        earlier = reuse.source_of(directory.path.name)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import difflib
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from etils import epath

from checkpointables import _confinement, errors, layout, storage

__all__ = [
    "SaveReuse",
    "current",
    "active",
    "checked_source",
    "checked_frozen",
    "log_once",
    "Frozen",
]

logger = logging.getLogger("checkpointables.reuse")

# A predicate on a leaf's key path (its string form, e.g. "params.encoder.w"): True for
# leaves the caller declares unchanged since the source (no fingerprint is computed).
Frozen = Callable[[str], bool]

_current: contextvars.ContextVar[SaveReuse | None] = contextvars.ContextVar(
    "checkpointables_reuse", default=None
)
_logged: set[str] = set()
_logged_lock = threading.Lock()


class SaveReuse:
    """What one save may reuse, and what it did reuse.

    Attributes:
      source: the committed checkpoint to take unchanged data from (``None``: reuse
        nothing this time, but record what a later save compares).
      frozen: leaves declared unchanged (a predicate on their key paths' string form):
        reused without a fingerprint if the source holds them with the same layout.
      bytes_reused: bytes of data the handlers took from ``source`` (not written).
    """

    def __init__(
        self, source: epath.Path | None, frozen: Frozen | None = None, identity: Any = None
    ) -> None:
        self.source = source
        self.frozen = None if frozen is None else checked_frozen(frozen)
        self.bytes_reused = 0
        # What tells the committed source from one that replaced it (on object stores the
        # content of its commit marker, read as this save starts: a future while it is
        # read; ``None``: not read). See ``source_identity``.
        self._identity = identity
        self._lock = threading.Lock()
        self._after_commit: list[Callable[[Callable[[], Any]], None]] = []

    @property
    def source_identity(self) -> Any:
        """The source's identity as this save found it (waits for its read; ``None``: not
        read). A handler may take what it read of that very commit earlier (``after_commit``).
        Where the read found no committed source any more, ``source`` becomes ``None``."""
        identity = self._identity
        if isinstance(identity, concurrent.futures.Future):
            identity = self._identity = identity.result()
            if identity is None:  # Deleted since it was listed: nothing is taken from it.
                self.source = None
        return identity

    def after_commit(self, callback: Callable[[Callable[[], Any]], None]) -> None:
        """Has ``callback(identity_of)`` run once this save has committed, on its background
        thread, before its response is done (a Checkpointer's saves only): a handler reads
        there what the next save will take from this checkpoint, keyed by ``identity_of()``
        (the identity of the checkpoint now, as the next save's ``source_identity`` is)."""
        with self._lock:
            self._after_commit.append(callback)

    def committed(self, identity_of: Callable[[], Any]) -> None:
        """Runs the ``after_commit`` callbacks (by the saver, once committed). Their failure
        costs the next save its head start only: logged, never raised."""
        with self._lock:
            callbacks, self._after_commit = self._after_commit, []
        for callback in callbacks:
            try:
                callback(identity_of)
            except Exception as e:  # A head start lost, never a failed save.
                logger.debug("After a save's commit, %r failed: %r", callback, e)

    def source_of(self, name: str) -> epath.Path | None:
        """The directory of checkpointable ``name`` in the source (``None``: no source)."""
        return None if self.source is None else self.source / name

    def add_reused(self, nbytes: int) -> None:
        """Counts ``nbytes`` taken from the source (thread-safe: handlers run concurrently)."""
        with self._lock:
            self.bytes_reused += int(nbytes)


_HELD_SHOWN = 5  # Checkpoints a hint names.


def _held_hint(directory: epath.Path, typo: str | None = None) -> str:
    """What ``directory`` holds, for a ``reuse_from`` that is no checkpoint: its committed
    checkpoints, or ``""`` if none. Step names (a Checkpointer's root) are called steps,
    newest first, and the newest suggested; other names are listed as checkpoints, those
    resembling ``typo`` (the name that was not found) first, and one suggested only if it
    resembles it: an arbitrary one would mislead."""
    if not storage.is_dir(directory):
        return ""
    held = sorted(
        (
            e.name
            for e in storage.list_dir(directory)
            if e.is_dir
            and not layout.is_temporary_path(e.name)
            and layout.is_checkpoint(directory / e.name)
        ),
        key=layout.natural_key,
    )
    if not held:
        return ""
    steps = all(layout.is_step_name(n) for n in held)
    # Step numbers are compared as numbers by whoever picks one, not as spellings.
    close = difflib.get_close_matches(typo, held, n=len(held)) if typo and not steps else []
    rest = [n for n in (reversed(held) if steps else held) if n not in close]
    ordered = close + rest
    shown = ", ".join(ordered[:_HELD_SHOWN])
    if len(ordered) > _HELD_SHOWN:
        shown += f" and {len(ordered) - _HELD_SHOWN} more"
    order = f"closest to {typo!r} first" if close else ("newest first" if steps else "")
    text = f" {directory} holds the {'steps' if steps else 'checkpoints'} {shown}"
    text += f" ({order})" if order else ""
    if close:
        return f"{text}: did you mean reuse_from={directory / close[0]}?"
    if steps:
        return f"{text}: pass one, e.g. reuse_from={directory / ordered[0]} (the newest)."
    like = f", none named like {typo!r}" if typo else ""
    return f"{text}{like}: pass the one to reuse from, reuse_from={directory}/<name>."


def current() -> SaveReuse | None:
    """The reuse of the save whose blocking phase is running (``None``: a plain save)."""
    return _current.get()


@contextlib.contextmanager
def active(reuse: SaveReuse | None) -> Iterator[None]:
    """Makes ``reuse`` the ``current()`` one inside the block."""
    token = _current.set(reuse)
    try:
        yield
    finally:
        _current.reset(token)


def checked_source(reuse_from: Any, target: epath.Path) -> epath.Path:
    """``reuse_from`` as a path, checked to be a committed checkpoint other than ``target``.

    Raises:
      cp.errors.CheckpointNotFoundError: nothing is at ``reuse_from`` (a FileNotFoundError).
      cp.errors.NotACheckpointError: it is not a committed checkpoint.
      cp.errors.InvalidArgumentError: it is the checkpoint being saved.
      cp.errors.OutsideCheckpointError: a symbolic link in it leads outside it.
      cp.errors.IntegrityError: it holds a named pipe, a socket or a device.
    """
    from checkpointables.path._parse import as_path

    source = as_path(reuse_from)
    if storage.key(source) == storage.key(target):
        raise errors.InvalidArgumentError(
            f"reuse_from={source} is the checkpoint being saved; pass an earlier checkpoint."
        )
    if not storage.exists(source):
        hint = _held_hint(source.parent, typo=source.name)
        raise errors.CheckpointNotFoundError(
            f"reuse_from={source} does not exist; pass a committed checkpoint, or None to "
            f"write everything.{hint}"
        )
    if not layout.is_checkpoint(source):
        raise errors.NotACheckpointError(
            f"reuse_from={source} is not a committed checkpoint (no commit marker); pass a "
            f"committed checkpoint, or None to write everything.{_held_hint(source)}"
        )
    # As a load would: no file outside it is compared, linked or copied into the new one.
    _confinement.check_contained(source)
    return source


def checked_frozen(predicate: Frozen) -> Frozen:
    """``predicate`` (``reuse_unchanged``'s declaration of frozen leaves), checked: it must
    take one argument, and answer ``True`` or ``False`` for every leaf name. A leaf it
    declares frozen is saved without a fingerprint, so a wrong answer is never guessed at.

    Raises:
      cp.errors.InvalidArgumentTypeError: ``predicate`` does not take one argument (at
        once), or returns something other than a bool (at the save that asks it).
      cp.errors.InvalidArgumentError: ``predicate`` raised on a leaf name (at the save).

    Example::

        frozen = cp.reuse.checked_frozen(lambda name: name.startswith("base."))
        frozen("base.w")  # True
    """
    if isinstance(predicate, _CheckedFrozen):
        return predicate
    try:
        inspect.signature(predicate).bind("params.w")
    except ValueError:  # No signature to read (some builtins): the first call tells.
        pass
    except TypeError as e:
        raise errors.InvalidArgumentTypeError(
            f"reuse_unchanged must be a predicate of one argument, a leaf's name as stored "
            f"(e.g. 'params.w'); {predicate!r} cannot be called so: {e}."
        ) from None
    return _CheckedFrozen(predicate)


class _CheckedFrozen:
    """A declaration of frozen leaves whose every answer is checked (``checked_frozen``)."""

    def __init__(self, predicate: Frozen) -> None:
        self._predicate = predicate

    def __call__(self, name: str) -> bool:
        try:
            answer = self._predicate(name)
        except Exception as e:
            raise errors.InvalidArgumentError(
                f"reuse_unchanged's predicate raised {e!r} on the leaf {name!r}: it must "
                f"answer True or False for every leaf name (names as stored, e.g. 'params.w')."
            ) from e
        if not _is_bool(answer):
            raise errors.InvalidArgumentTypeError(
                f"reuse_unchanged's predicate returned {answer!r} for the leaf {name!r}; it "
                f"must return True or False (a leaf declared frozen is saved without a "
                f"fingerprint, so nothing else is taken for an answer)."
            )
        return bool(answer)


def _is_bool(answer: object) -> bool:
    """Whether ``answer`` is True or False: Python's, or NumPy's (a comparison's result)."""
    kind = type(answer)
    return kind is bool or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))


def log_once(key: str, message: str, level: int = logging.INFO) -> None:
    """Logs ``message`` (at ``level``, INFO by default) the first time ``key`` is seen in
    this process: a backend that cannot reuse says so once, not at every save. A WARNING
    is for reuse that was asked for and cannot happen as asked (a ``reuse_from`` holding
    no checkpointable of the save's name).

    Example::

        cp.reuse.log_once(f"remote:{scheme}", f"{scheme}:// cannot copy on the server.")
    """
    with _logged_lock:
        if key in _logged:
            return
        _logged.add(key)
    logger.log(level, message)
