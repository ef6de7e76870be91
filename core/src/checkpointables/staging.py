"""Host memory a save stages: the most bytes its handlers held on the host at once.

Every save hands its handlers a ``SaveStaging`` for the duration of their
blocking phase: ``current()``. A handler that stages data on the host on its
way to storage (the pytree plugin: device-to-host copies, dtype casts, encoded
buffers) keeps it and, once its writes are done, reports the most it held at
once with ``report``. Core records the save's peak in the checkpoint's
``_CHECKPOINT_METADATA`` (``performance_metrics``, under ``PEAK_STAGING_BYTES``;
``checkpointables inspect`` shows it) and the training ``Checkpointer`` in
``last_save_stats.peak_staging_bytes``. A handler that does not report counts 0.

Guide: ``docs/memory.md``.

Example (a handler)::

    staging = cp.staging.current()          # in the blocking phase
    async def write():
        ...                                 # the writes, counting what they hold
        if staging is not None:
            staging.report(peak)
    return write()
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["SaveStaging", "current", "active", "PEAK_STAGING_BYTES", "recorded_peak"]

# The key of the peak in the ``performance_metrics`` of ``_CHECKPOINT_METADATA``. An
# integer: Orbax keeps only floats there and ignores it.
PEAK_STAGING_BYTES = "peak_staging_bytes"

_current: contextvars.ContextVar[SaveStaging | None] = contextvars.ContextVar(
    "checkpointables_staging", default=None
)


class SaveStaging:
    """What the handlers of one save staged on the host (this process's).

    Attributes:
      peak_bytes: the sum of the peaks the handlers reported (handlers write
        concurrently: their peaks may coincide, and the sum bounds the save's).
      reported: whether any handler reported (a save of handlers that stage nothing
        records no peak).
    """

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.reported = False
        self._lock = threading.Lock()

    def report(self, peak_bytes: int) -> None:
        """Adds one handler's peak (thread-safe: handlers run concurrently)."""
        with self._lock:
            self.peak_bytes += int(peak_bytes)
            self.reported = True

    def performance_metrics(self) -> dict[str, Any]:
        """What ``_CHECKPOINT_METADATA`` records of it (``{}`` if no handler reported)."""
        return {PEAK_STAGING_BYTES: self.peak_bytes} if self.reported else {}


def current() -> SaveStaging | None:
    """The staging of the save whose blocking phase is running (``None``: not in a save)."""
    return _current.get()


@contextlib.contextmanager
def active(staging: SaveStaging | None) -> Iterator[None]:
    """Makes ``staging`` the ``current()`` one inside the block."""
    token = _current.set(staging)
    try:
        yield
    finally:
        _current.reset(token)


def recorded_peak(meta: Mapping[str, Any]) -> int | None:
    """The peak recorded in the parsed ``_CHECKPOINT_METADATA`` ``meta`` (``None``: none, or
    not an integer: a checkpoint saved before it was recorded, or by another tool)."""
    metrics = meta.get("performance_metrics")
    value = metrics.get(PEAK_STAGING_BYTES) if isinstance(metrics, dict) else None
    return value if type(value) is int and value >= 0 else None
