"""Read leases: steps being read in this process, so garbage collection never deletes one
mid-load.

Shared by every Checkpointer of the process (a trainer and an evaluator may
watch the same root). A load registers its step directory before it checks
that the directory exists; a deletion checks for readers and renames the
directory away under the same lock. So either the load sees the step gone
(and raises ``StepNotFoundError``) or the deletion sees the reader and waits.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from etils import epath

from checkpointables import storage
from checkpointables._asyncio import AsyncResponse, start_background
from checkpointables.context import Context
from checkpointables.training.errors import StepNotFoundError
from checkpointables.training.step_info import StepInfo

T = TypeVar("T")

_condition = threading.Condition()
_readers: dict[str, int] = {}


def acquire(path: epath.Path) -> str:
    """Registers a reader of ``path``; returns the key to ``release``."""
    key = storage.key(path)
    with _condition:
        _readers[key] = _readers.get(key, 0) + 1
    return key


def release(key: str) -> None:
    """Ends a read registered by ``acquire``."""
    with _condition:
        count = _readers.get(key, 0) - 1
        if count > 0:
            _readers[key] = count
        else:
            _readers.pop(key, None)
        _condition.notify_all()


def is_read(path: epath.Path) -> bool:
    """Whether a load of ``path`` is in progress in this process."""
    with _condition:
        return storage.key(path) in _readers


def run_if_unread(path: epath.Path, action: Callable[[], T]) -> tuple[bool, T | None]:
    """Runs ``action`` (e.g. a rename) unless ``path`` is being read; atomic with ``acquire``.

    Returns ``(True, result)`` if it ran, ``(False, None)`` if a reader exists.
    """
    with _condition:
        if storage.key(path) in _readers:
            return False, None
        return True, action()


def wait_until_unread(path: epath.Path, timeout: float | None) -> None:
    """Blocks until no load of ``path`` is in progress.

    Raises:
      TimeoutError: loads are still running after ``timeout`` seconds.
    """
    key = storage.key(path)
    with _condition:
        if not _condition.wait_for(lambda: key not in _readers, timeout):
            raise TimeoutError(
                f"Loads of {path} are still running after {timeout} s; the step cannot be "
                f"overwritten while it is being read. Wait for them, or raise the timeout "
                f"(cp.options.AsyncOptions(timeout_secs=...))."
            )


class Leases:
    """The leases of one Checkpointer's reads; ``on_release`` runs when one ends (deletions
    deferred for the read may then run)."""

    def __init__(self, root: epath.Path, on_release: Callable[[], None]) -> None:
        self._root = root
        self._on_release = on_release

    def _acquire(self, info: StepInfo, context: Context) -> str:
        key = acquire(info.path)
        with context:
            gone = not storage.exists(info.path)
        if gone:
            self._release(key)
            raise StepNotFoundError(
                f"Step {info.step} was deleted from {self._root} (by this run's preservation "
                f"policy or another process). Call steps() for what remains."
            )
        return key

    def _release(self, key: str) -> None:
        release(key)
        self._on_release()

    @contextlib.contextmanager
    def holding(self, info: StepInfo, context: Context) -> Iterator[StepInfo]:
        """``info``, leased during the block, which runs under ``context``."""
        key = self._acquire(info, context)
        try:
            with context:
                yield info
        finally:
            self._release(key)

    def load_async(
        self, info: StepInfo, context: Context, start: Callable[[epath.Path], AsyncResponse[T]]
    ) -> AsyncResponse[T]:
        """``start(path)`` for the step; the step stays leased until the load finishes."""
        key = self._acquire(info, context)
        try:
            with context:
                inner = start(info.path)
        except BaseException:
            self._release(key)
            raise

        def finish() -> T:
            try:
                return inner.result()
            finally:
                self._release(key)

        description = f"load of step {info.step} from {self._root}"
        return start_background(finish, description, daemon=True)
