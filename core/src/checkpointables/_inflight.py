"""Background operations still running, by checkpoint path, and the heartbeats of saves.

A later save or load of a path waits for an earlier save to it, so that
``save_async(p); load(p)`` sees the finished checkpoint. A save still writing
refreshes a heartbeat (``Heartbeat``) that tells other processes it is alive
(``_leftovers``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from etils import epath

from checkpointables import storage
from checkpointables._asyncio import AsyncResponse

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_running: dict[str, AsyncResponse[Any]] = {}


def wait_for(path: epath.Path, timeout: float | None) -> None:
    """Waits for a save of ``path`` still in flight; its errors stay with its response."""
    with _lock:
        response = _running.get(storage.key(path))
    if response is not None:
        response.exception(timeout)


def track(path: epath.Path, response: AsyncResponse[Any]) -> None:
    """Records ``response`` as the operation on ``path`` until it finishes."""
    k = storage.key(path)
    with _lock:
        _running[k] = response

    def forget(done: AsyncResponse[Any]) -> None:
        with _lock:
            if _running.get(k) is done:
                del _running[k]

    response.add_done_callback(forget)


def wait_all(timeout: float | None = None) -> None:
    """Waits for every save in flight (used by tests and at shutdown)."""
    with _lock:
        responses = list(_running.values())
    for response in responses:
        response.exception(timeout)


class Heartbeat:
    """Calls ``beat()`` every ``interval`` seconds, from the start, until ``stop()``.

    Every heartbeat of the process shares one daemon thread (started with the first): a
    save's start only adds an entry, so the caller (a training thread) neither starts a
    thread nor waits for one. A save that ends within its first interval never beats. A
    beat that fails is logged and retried at the next interval (the save's leftover rule
    allows for a few lost beats: see ``_leftovers``).
    """

    def __init__(self, beat: Callable[[], None], interval: float) -> None:
        self._beat = beat
        self._interval = interval
        self._due = time.monotonic() + interval
        self._stopped = False
        self._beating = threading.Lock()  # Held while it beats: stop() waits for that beat.
        with _beats_changed:
            _beats.add(self)
            _start_beats_thread()
            _beats_changed.notify()

    def stop(self) -> None:
        """Stops the heartbeat: returns once no beat runs and none will (idempotent)."""
        with _beats_changed:
            _beats.discard(self)
        with self._beating:
            self._stopped = True

    def _run_if_due(self, now: float) -> float:
        """Beats if it is time; returns when it is next due."""
        if now >= self._due:
            with self._beating:
                if self._stopped:
                    return float("inf")
                try:
                    self._beat()
                except Exception as e:  # A lost beat: the next one may succeed.
                    _log.warning("checkpointables: a save's heartbeat failed: %s", e)
            self._due = time.monotonic() + self._interval
        return self._due


_beats: set[Heartbeat] = set()
_beats_changed = threading.Condition()
_beats_thread: threading.Thread | None = None


def _start_beats_thread() -> None:
    """Starts the heartbeats' thread if this process has none yet (a forked child does not
    have its parent's); called with ``_beats_changed`` held."""
    global _beats_thread
    if _beats_thread is None or not _beats_thread.is_alive():
        _beats_thread = threading.Thread(
            target=_run_beats, name="checkpointables-heartbeat", daemon=True
        )
        _beats_thread.start()


def _run_beats() -> None:
    while True:
        with _beats_changed:
            beats = list(_beats)
        next_due = min((b._run_if_due(time.monotonic()) for b in beats), default=float("inf"))
        with _beats_changed:
            unchanged = set(_beats) == set(beats)
            # Not held while this waits: a stopped save's heartbeat (what its beat refers to)
            # is freed when the save ends, not at the next beat, up to an hour later.
            del beats
            if unchanged:  # Nothing added meanwhile: sleep until one is due.
                _beats_changed.wait(min(next_due - time.monotonic(), 3600.0))


def _after_fork_in_child() -> None:
    """A forked child has no save of its parent's to vouch for, nor the heartbeats' thread
    (its lock may have been held by that thread at the fork)."""
    global _beats_changed, _beats_thread
    _beats.clear()
    _beats_changed = threading.Condition()
    _beats_thread = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
