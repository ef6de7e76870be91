"""What a handler may use of how the library runs its work: GC pauses, the waiting caller.

Public for plugins: a third-party handler uses these exactly as the built-in
ones do.

``paused_gc()`` pauses Python's cyclic garbage collector around allocation-heavy sections.

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

from checkpointables._asyncio import caller_waits

__all__ = ["paused_gc", "caller_waits"]

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Disables the cyclic garbage collector for the ``with`` body.

    Pauses nest, across threads: the collector is re-enabled by the last one
    out, and only if it was enabled before. Use it around CPU-bound sections
    that allocate many small objects, never around waits for I/O.

    Example::

        with cp.execution.paused_gc():
            entries = [describe(leaf) for leaf in leaves]
    """
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
