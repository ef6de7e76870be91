"""What a save stages on the host: the bytes it holds now, and the most it held at once.

Counted where the save makes host memory for data on its way to storage:
device-to-host copies and dtype casts of the blocking phase (held until the
writes end), streamed chunks (held until committed, twice: fetched and encoded),
and the joined copies of data files PUT to an object store. Views of CPU devices'
own buffers and the caller's NumPy arrays of a synchronous save are not staging:
they are the state itself. The peak is reported to core (``cp.staging``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["Staging"]


class Staging:
    """Host bytes held for writing: ``now`` and ``peak`` (thread-safe)."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self._lock = threading.Lock()

    def hold(self, nbytes: int) -> None:
        """Counts ``nbytes`` more held."""
        with self._lock:
            self.now += nbytes
            self.peak = max(self.peak, self.now)

    def release(self, nbytes: int) -> None:
        """Counts ``nbytes`` freed."""
        with self._lock:
            self.now -= nbytes

    @contextlib.contextmanager
    def held(self, nbytes: int) -> Iterator[None]:
        """Counts ``nbytes`` held inside the block."""
        self.hold(nbytes)
        try:
            yield
        finally:
            self.release(nbytes)
