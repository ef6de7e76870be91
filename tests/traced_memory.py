"""The peak of Python's own allocations (``tracemalloc``) within a block: what a test of a
hostile file asserts to show that the file was refused unread."""

from __future__ import annotations

import tracemalloc
from typing import Any

__all__ = ["TracedPeak"]


class TracedPeak:
    """Traces allocations within a ``with`` block; ``peak`` is their peak, in bytes::

    with TracedPeak() as traced:
        cp.load_pytree(hostile_checkpoint)
    assert traced.peak < 64 << 20
    """

    peak = 0

    def __enter__(self) -> TracedPeak:
        tracemalloc.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
