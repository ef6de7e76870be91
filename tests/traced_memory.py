"""The peak of Python's own allocations (``tracemalloc``) within a block: what a test of a
hostile file asserts to show that the file was refused unread."""

from __future__ import annotations

import os
import sys
import threading
import time
import tracemalloc
from typing import Any

__all__ = ["TracedPeak"]

# A thread whose innermost frame is in these files waits for new work or for I/O (an idle
# worker's queue, a server's select): not for work it started, which counts as working.
_WAITING_IN = frozenset({"queue.py", "selectors.py"})


def _library_threads_working() -> bool:
    """Whether another thread is in the library's code, unless idle (``_WAITING_IN``)."""
    here = threading.get_ident()
    for ident, frame in sys._current_frames().items():
        if ident == here or os.path.basename(frame.f_code.co_filename) in _WAITING_IN:
            continue
        while frame is not None:
            if "checkpointables" in frame.f_code.co_filename:
                return True
            frame = frame.f_back
    return False


class TracedPeak:
    """Traces allocations within a ``with`` block; ``peak`` is their peak, in bytes::

    with TracedPeak() as traced:
        cp.load_pytree(hostile_checkpoint)
    assert traced.peak < 64 << 20

    Tracing stops once no other thread runs the library's code: CPython 3.11's
    ``tracemalloc.stop()`` can crash a thread that allocates meanwhile (a segfault
    seen when a failed load's prefetch thread outlived the load).
    """

    peak = 0

    def __enter__(self) -> TracedPeak:
        tracemalloc.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.peak = tracemalloc.get_traced_memory()[1]
        deadline = time.monotonic() + 10
        while _library_threads_working() and time.monotonic() < deadline:
            time.sleep(0.005)
        tracemalloc.stop()
