"""Waiting for many TensorStore futures with one wake-up of the event loop (``_ts_futures``)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import tensorstore as ts
from checkpointables_pytree import storage


def _complete_later(promises: list[ts.Promise], values: list[object]) -> threading.Thread:
    """Completes ``promises`` from another thread, last one first, a little later."""

    def run() -> None:
        time.sleep(0.05)
        for promise, value in reversed(list(zip(promises, values, strict=True))):
            if isinstance(value, Exception):
                promise.set_exception(value)
            else:
                promise.set_result(value)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_results_come_in_order_whatever_order_the_futures_finish_in() -> None:
    done_promise, done_future = ts.Promise.new()
    done_promise.set_result("ready")
    pairs = [ts.Promise.new() for _ in range(5)]
    thread = _complete_later([p for p, _ in pairs], list(range(5)))
    futures = [pairs[0][1], done_future, *(f for _, f in pairs[1:])]
    try:
        assert asyncio.run(storage.wait_all(futures)) == [0, "ready", 1, 2, 3, 4]
    finally:
        thread.join()


def test_the_first_failure_in_order_is_raised_once_all_are_done() -> None:
    pairs = [ts.Promise.new() for _ in range(3)]
    thread = _complete_later([p for p, _ in pairs], [ValueError("first"), 1, KeyError("second")])
    try:
        with pytest.raises(ValueError, match="first"):
            asyncio.run(storage.wait_all([f for _, f in pairs]))
        assert all(f.done() for _, f in pairs)
    finally:
        thread.join()


def test_real_opens_and_nothing_at_all() -> None:
    async def main() -> list[object]:
        assert await storage.wait_all([]) == []
        spec = {
            "driver": "zarr3",
            "kvstore": "memory://",
            "metadata": {"shape": [4], "data_type": "int32"},
        }
        return await storage.wait_all([ts.open(spec, create=True) for _ in range(3)])

    stores = asyncio.run(main())
    assert [s.shape for s in stores] == [(4,)] * 3
