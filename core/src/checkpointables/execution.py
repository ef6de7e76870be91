"""What a handler may use of how the library runs its work: GC pauses, the waiting caller.

Public for plugins: a third-party handler uses these exactly as the built-in
ones do.

``caller_waits()`` tells a handler that its caller waits for the result (``save_pytree``
rather than ``save_pytree_async``): the caller cannot touch its objects before the
call returns, so the handler may skip defensive copies.

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
import contextvars
import gc
import threading
from collections.abc import Iterator

__all__ = ["paused_gc", "caller_waits", "waiting_caller"]

_caller_waits: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "checkpointables_caller_waits", default=False
)


def caller_waits() -> bool:
    """True while a synchronous save or load runs (``save_pytree``, ``load_pytree``, ...).

    The caller cannot touch its objects until the call returns, so a handler's
    blocking phase may skip the defensive host copies an async save needs, and
    save memory. The library then also runs the background phase on the
    caller's thread.

    Example::

        data = array if cp.execution.caller_waits() else np.array(array, copy=True)
    """
    return _caller_waits.get()


@contextlib.contextmanager
def waiting_caller() -> Iterator[None]:
    """Marks the calls in the ``with`` body as made by a caller that waits for their result
    (``caller_waits()`` is true there): what the synchronous forms do."""
    token = _caller_waits.set(True)
    try:
        yield
    finally:
        _caller_waits.reset(token)


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
