"""Pausing Python's cyclic garbage collector around allocation-heavy sections.

Flattening a tree, parsing ``_METADATA`` and decoding thousands of small
arrays allocate hundreds of thousands of small objects, none of them in
cycles. Each allocation burst triggers collections that scan the whole heap
(large once JAX is imported: one full collection took 45 ms here, a sixth
of a 5,000-leaf save): on such trees they cost more than the work itself.
A synchronous save or load pauses the collector for its whole call (memory
is still freed by reference counting); an asynchronous one for its blocking
phase only. The pauses nest across threads; the collector is re-enabled by
the last one out, and only if it was enabled before.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["paused"]

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Disables the cyclic garbage collector for the ``with`` body."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
