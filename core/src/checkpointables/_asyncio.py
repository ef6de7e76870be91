"""Running coroutines from synchronous code, background work with a result, and the
synchronous forms of the library's async functions."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import concurrent.futures.thread  # Its exit hook must be registered before ours.
import contextvars
import functools
import inspect
import logging
import os
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Generic, ParamSpec, TypeVar

from checkpointables.execution import caller_waits, paused_gc, waiting_caller

T = TypeVar("T")
U = TypeVar("U")
P = ParamSpec("P")
_log = logging.getLogger(__name__)

__all__ = [
    "AsyncResponse",
    "run_sync",
    "start_background",
    "completed",
    "synchronous",
    "concurrently",
    "caller_waits",
    "waiting_caller",
]


class _ThreadLoop:
    """The event loop ``run_sync`` reuses on one thread; closed when the thread ends.

    ``asyncio.run`` creates and closes a loop (and its default executor's
    threads) on every call: about 0.1 ms, and 1 ms once the coroutine used
    ``asyncio.to_thread``. A tiny checkpoint's save or load makes several such
    calls, so each thread keeps one loop (and its executor) instead.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        _open_loops.add(self.loop)

    def __del__(self) -> None:
        # A forked child drops the loops of its parent's other threads: closing one there
        # would unregister the parent's self-pipe from their shared epoll instance, and the
        # parent's loop would never wake again.
        if self.pid == os.getpid():
            _close_quietly(self.loop)


_thread_loops = threading.local()
_open_loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
# Loops inherited by a forked child: they share file descriptors (epoll, self-pipe) with the
# parent, so the child must neither use nor close them. Kept here so they are never collected.
_inherited: list[Any] = []


def _close_quietly(loop: asyncio.AbstractEventLoop) -> None:
    try:
        if not loop.is_closed() and not loop.is_running():
            loop.close()
    except Exception:  # Interpreter shutdown: nothing left to release.
        pass


@atexit.register
def _close_open_loops() -> None:
    for loop in list(_open_loops):
        _close_quietly(loop)


def _after_fork_in_child() -> None:
    global _thread_loops
    _inherited.append(_thread_loops)
    _inherited.extend(_open_loops)
    _open_loops.clear()
    _thread_loops = threading.local()
    # The parent's pool threads do not exist here: the child starts its own.
    _pool.cache_clear()
    _background_pool.cache_clear()
    _running.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _this_threads_loop() -> asyncio.AbstractEventLoop:
    holder = getattr(_thread_loops, "holder", None)
    if holder is None or holder.loop.is_closed() or holder.pid != os.getpid():
        holder = _thread_loops.holder = _ThreadLoop()
    return holder.loop


def _cancel_leftover_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """What ``asyncio.run`` does on exit: cancel tasks the coroutine left running, and wait."""
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    if not tasks:
        return
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


def _in_running_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Runs ``coro`` to completion from synchronous code, even inside a running loop."""
    if not _in_running_loop():
        # Outside the except clause above: errors of `coro` must not chain to its RuntimeError.
        loop = _this_threads_loop()
        try:
            return loop.run_until_complete(coro)
        finally:
            _cancel_leftover_tasks(loop)
    # Called from inside an event loop (e.g. a notebook): use a helper thread.
    ctx = contextvars.copy_context()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(ctx.run, asyncio.run, coro).result()


class AsyncResponse(Generic[T]):
    """The result of work running in the background.

    ``result(timeout)`` waits and returns it, or re-raises the background
    error with its traceback; ``done()`` tells without waiting.

    Example::

        response = cp.save_pytree_async(path, state)
        ...                       # keep training
        response.result()         # raises if the save failed
    """

    def __init__(self, description: str) -> None:
        self._description = description
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[AsyncResponse[T]], None]] = []
        self._lock = threading.Lock()

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            self._value, self._error = value, error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def done(self) -> bool:
        """Whether the background work has finished (successfully or not)."""
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> T:
        """Waits for the work and returns its result.

        Raises:
          TimeoutError: the work is still running after ``timeout`` seconds.
          Exception: whatever the background work raised, with its traceback.
        """
        if not self._event.wait(timeout):
            raise TimeoutError(
                f"{self._description} is still running after {timeout} s; call result() again "
                f"to keep waiting."
            )
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Waits like ``result`` and returns the background error, or ``None``."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self._description} is still running after {timeout} s.")
        return self._error

    def add_done_callback(self, callback: Callable[[AsyncResponse[T]], None]) -> None:
        """Calls ``callback(self)`` when the work finishes (at once if it has)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<AsyncResponse {self._description}: {state}>"


def completed(value: T, description: str = "operation") -> AsyncResponse[T]:
    """An ``AsyncResponse`` that is already done with ``value``."""
    response: AsyncResponse[T] = AsyncResponse(description)
    response._finish(value)
    return response


def start_background(
    work: Callable[[], T], description: str, *, daemon: bool = False, inline: bool = False
) -> AsyncResponse[T]:
    """Runs ``work()`` on a background thread, in a copy of the caller's contextvars.

    The thread is not a daemon by default, so the interpreter waits for a
    running save before it exits instead of cutting it off; a ``daemon`` one (a
    load nobody may still want) is a new thread. With ``inline``,
    and for a caller that waits for the result right away (``caller_waits()``:
    ``save_pytree``, ``load_pytree``), ``work()`` runs now, on the caller's
    thread: no thread start and no hand-over, which is most of a tiny
    checkpoint's time.
    """
    response: AsyncResponse[T] = AsyncResponse(description)
    ctx = contextvars.copy_context()

    def run() -> None:
        try:
            value = ctx.run(work)
        except BaseException as e:
            response._finish(error=e)
        else:
            response._finish(value)

    if inline or caller_waits():
        run()
    elif daemon:
        name = f"checkpointables: {description}"[:60]
        threading.Thread(target=run, name=name, daemon=True).start()
    else:
        with _running_lock:
            _running.add(response)
        response.add_done_callback(_forget_running)
        _background_pool().submit(run)
    return response


# Background work the interpreter must finish before it exits (not daemons).
_running_lock = threading.Lock()
_running: set[AsyncResponse[Any]] = set()


def _forget_running(response: AsyncResponse[Any]) -> None:
    with _running_lock:
        _running.discard(response)


def _finish_running_work() -> None:
    """Waits, at interpreter exit, for background saves still running.

    Python's exit first shuts every thread pool to new work (``concurrent.futures``
    refuses it from then on), then waits for threads: a save still running then
    would fail at its next hand-over to a pool, unseen, and be lost. This runs
    before that shutdown (``threading``'s exit hooks run newest first), so a
    script that ends right after ``save_pytree_async`` still writes its checkpoint.
    A save that fails here is logged: nobody is left to call ``result()``.
    """
    while True:
        with _running_lock:
            running = list(_running)
        if not running:
            return
        _log.info("checkpointables: waiting for %d background save(s) before exit", len(running))
        for response in running:
            error = response.exception()
            if error is not None:
                _log.error("checkpointables: %s failed at exit: %s", response, error)


# concurrent.futures.thread registered its exit hook when imported (above): this one,
# registered later, runs before it.
threading._register_atexit(_finish_running_work)  # type: ignore[attr-defined]


@functools.cache
def _background_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for saves' background phases, kept between saves.

    Starting a thread costs the caller more than its start: the new thread takes
    the GIL at once and the caller waits up to a switch interval (5 ms) to get it
    back, while an idle worker woken by a queue lets the caller return first. A
    worker is added whenever none is idle, so background work never waits for
    other background work; the interpreter waits for running work before it exits.
    """
    return concurrent.futures.ThreadPoolExecutor(1024, thread_name_prefix="checkpointables-bg")


async def gather_awaitables(awaitables: list[Any]) -> list[Any]:
    """Awaits every awaitable concurrently; returns their results in order.

    If any fails, the first error is raised once all have finished, and the
    coroutines the others returned (their background phases, which will now
    never run) are closed, so no "never awaited" warning follows the error.
    """
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        for r in results:
            if inspect.iscoroutine(r):
                r.close()
        raise failures[0]
    return list(results)


def synchronous(
    start: Callable[P, AsyncResponse[T]],
) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """Makes a stub (its signature and docstring) the synchronous form of ``start``.

    The synchronous form calls ``start`` as a waiting caller (see
    ``cp.execution.caller_waits``: the background phase then runs on the
    caller's thread, with no thread start and no hand-over), with the cyclic GC
    paused for the whole call, and returns the result or raises the error.

    Example::

        @synchronous(save_pytree_async)
        def save_pytree(path, pytree, *, overwrite=False) -> None:
            '''Saves a pytree and waits until it is committed.'''
    """

    def make(stub: Callable[P, T]) -> Callable[P, T]:
        @functools.wraps(stub)
        def wait(*args: P.args, **kwargs: P.kwargs) -> T:
            with waiting_caller(), paused_gc():
                try:
                    response = start(*args, **kwargs)
                except TypeError as e:
                    _name_the_stub(stub, args, kwargs, e)
                    raise
            return response.result()

        return wait

    return make


def _name_the_stub(stub: Callable[..., Any], args: Any, kwargs: Any, error: TypeError) -> None:
    """Raises a ``TypeError`` naming ``stub`` where its arguments do not fit it (``error``
    would name the function it starts: ``save_pytree_async`` for ``save_pytree``)."""
    try:
        inspect.signature(stub).bind(*args, **kwargs)
    except TypeError as mismatch:
        raise TypeError(f"{stub.__qualname__}() {mismatch}") from error


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="checkpointables-io")


def concurrently(function: Callable[[U], T], items: Iterable[U]) -> list[T]:
    """``[function(item) for item in items]``, up to 16 at once, each in a copy of the
    caller's contextvars (its ``cp.Context``); raises the first error.

    For many small blocking requests (flushing the files of a checkpoint, deleting
    the objects of one): issued together they overlap their waits.
    """
    items = list(items)
    if len(items) <= 1:
        return [function(item) for item in items]
    futures = [_pool().submit(contextvars.copy_context().run, function, item) for item in items]
    return [future.result() for future in futures]
