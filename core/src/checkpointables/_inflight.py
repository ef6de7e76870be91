"""Background operations still running, by checkpoint path.

A later save or load of a path waits for an earlier save to it, so that
``save_async(p); load(p)`` sees the finished checkpoint.
"""

from __future__ import annotations

import threading
from typing import Any

from etils import epath

from checkpointables import storage
from checkpointables._asyncio import AsyncResponse

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
