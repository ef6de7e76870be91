"""Waiting for many TensorStore futures from an event loop, with one wake-up.

Also what the reader and the writer share to wait safely: ``settle`` (let
the other tasks end after one failed) and ``ByteLimiter`` (bytes in flight).

``await future`` on a TensorStore future schedules a callback on the event
loop for that future alone: the loop's thread wakes up once per future. A
save of thousands of arrays waits for an open and a copy per array, and
those wake-ups cost more of the loop's thread than the opens themselves.
``wait_all`` counts the futures down in TensorStore's threads and wakes the
loop once, when the last one is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

__all__ = ["ByteLimiter", "settle", "wait_all"]


async def wait_all(futures: Sequence[Any]) -> list[Any]:
    """The results of ``futures`` (TensorStore futures), in order, once every one is done.

    Raises the exception of the first failed future (in order). Example::

        stores = await wait_all([ts.open(spec) for spec in specs])
    """
    pending = [f for f in futures if not f.done()]
    if pending:
        loop = asyncio.get_running_loop()
        all_done: asyncio.Future[None] = loop.create_future()
        left = len(pending)
        lock = threading.Lock()

        def wake() -> None:
            if not all_done.done():
                all_done.set_result(None)

        def one_done(_: Any) -> None:  # Runs in whichever thread completes the future.
            nonlocal left
            with lock:
                left -= 1
                last = left == 0
            if last:
                # A closed loop (its caller gave up waiting) has nobody to wake.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(wake)

        for future in pending:
            future.add_done_callback(one_done)
        await all_done
    return [f.result() for f in futures]


class ByteLimiter:
    """Lets tasks hold up to ``limit`` bytes at once (a task larger than that runs alone)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self._condition: asyncio.Condition | None = None

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        """Waits until ``nbytes`` fit, holds them for the ``async with`` body."""
        if self._condition is None:
            self._condition = asyncio.Condition()
        condition = self._condition
        nbytes = min(max(nbytes, 1), self._limit)
        async with condition:
            await condition.wait_for(lambda: self._used + nbytes <= self._limit)
            self._used += nbytes
        try:
            yield
        finally:
            async with condition:
                self._used -= nbytes
                condition.notify_all()


async def settle(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Lets the other tasks finish after one failed.

    Cancelling a task that awaits a TensorStore future leaves the future's
    callback pointing at this event loop, which may be closed by the time
    the I/O ends; waiting for them is safe, and bounded by their I/O.
    """
    await asyncio.gather(*tasks, return_exceptions=True)


async def gather_settled(tasks: Sequence[asyncio.Future[Any]]) -> list[Any]:
    """``asyncio.gather`` of ``tasks``; if one fails, the others are let finish
    (``settle``) before its error is raised."""
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        await settle(tasks)
        raise
