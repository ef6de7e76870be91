"""Steps being read in this process, so garbage collection never deletes one mid-load.

Shared by every Checkpointer of the process (a trainer and an evaluator may
watch the same root). A load registers its step directory before it checks
that the directory exists; a deletion checks for readers and renames the
directory away under the same lock. So either the load sees the step gone
(and raises ``StepNotFoundError``) or the deletion sees the reader and waits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from etils import epath

from checkpointables import _inflight

T = TypeVar("T")

_condition = threading.Condition()
_readers: dict[str, int] = {}


def acquire(path: epath.Path) -> str:
    """Registers a reader of ``path``; returns the key to ``release``."""
    key = _inflight.key(path)
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
        return _inflight.key(path) in _readers


def run_if_unread(path: epath.Path, action: Callable[[], T]) -> tuple[bool, T | None]:
    """Runs ``action`` (e.g. a rename) unless ``path`` is being read; atomic with ``acquire``.

    Returns ``(True, result)`` if it ran, ``(False, None)`` if a reader exists.
    """
    with _condition:
        if _inflight.key(path) in _readers:
            return False, None
        return True, action()


def wait_until_unread(path: epath.Path, timeout: float | None) -> None:
    """Blocks until no load of ``path`` is in progress.

    Raises:
      TimeoutError: loads are still running after ``timeout`` seconds.
    """
    key = _inflight.key(path)
    with _condition:
        if not _condition.wait_for(lambda: key not in _readers, timeout):
            raise TimeoutError(
                f"Loads of {path} are still running after {timeout} s; the step cannot be "
                f"overwritten while it is being read. Wait for them, or raise the timeout "
                f"(cp.options.AsyncOptions(timeout_secs=...))."
            )
