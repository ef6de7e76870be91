"""Requests per save and load: few, and not growing with the number of leaves.

Object stores charge per request and each costs tens of milliseconds, so a
tree of thousands of small arrays must not cost thousands of requests.
Counted by a proxy of our own between the library and the server.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import threading

import checkpointables as cp
import numpy as np
import pytest

from ...object_store_server import S3Proxy
from .helpers import assert_equal


@pytest.fixture
def proxy(s3):
    proxy = S3Proxy(s3.endpoint)
    yield proxy
    proxy.stop()


def _counts(proxy: S3Proxy, path: str, tree: dict) -> tuple[int, int, int]:
    """(requests of a save, of which PUTs, requests of a load) of ``tree``."""
    with cp.Context(storage_options=cp.options.StorageOptions(endpoint=proxy.endpoint)):
        with proxy.counting() as saved:
            cp.save_pytree(path, tree)
        with proxy.counting() as loaded:
            assert_equal(cp.load_pytree(path), tree)
    return saved.total, saved.requests["PUT"], loaded.total


@pytest.mark.fast_path  # The database written and read in few requests by the fast path.
def test_thousands_of_small_arrays_cost_a_few_requests(s3, proxy) -> None:
    bucket = f"s3://{s3.new_bucket()}"
    rng = np.random.default_rng(0)
    small = {f"leaf{i}": rng.random(int(rng.integers(64, 4096))) for i in range(100)}
    many = {f"leaf{i}": rng.random(int(rng.integers(64, 4096))) for i in range(3000)}
    few_save, _, few_load = _counts(proxy, f"{bucket}/few", small)
    save, puts, load = _counts(proxy, f"{bucket}/many", many)
    assert puts <= 20 and save <= 40, (save, dict(proxy.counts.requests))
    assert load <= 30, load
    # Thirty times the leaves, about the same requests.
    assert save <= few_save + 10 and load <= few_load + 10, (few_save, save, few_load, load)


def test_threads_of_one_operation_fetch_the_checksums_once(s3, proxy) -> None:
    path = f"s3://{s3.new_bucket()}/ckpt"
    cp.save_checkpointables(path, {"extra": {"k": 1}})
    threads = 8
    start = threading.Barrier(threads)

    def read_metadata() -> bytes:
        start.wait()  # All at once: each would otherwise look for the table itself.
        return cp.metadata_checksums.read_file(f"{path}/_CHECKPOINT_METADATA")

    with cp.Context(storage_options=cp.options.StorageOptions(endpoint=proxy.endpoint)):
        cp.storage.exists(path)  # The store opened before counting.
        with (
            proxy.counting() as counts,
            cp.metadata_checksums.scope(),
            concurrent.futures.ThreadPoolExecutor(threads) as pool,
        ):
            # The scope's table reaches each thread as a load's background work gets it.
            read = [
                pool.submit(contextvars.copy_context().run, read_metadata) for _ in range(threads)
            ]
            assert len({future.result() for future in read}) == 1
    # The table by a bounded read (a ranged GET of one byte, then the object), once; then
    # each thread's file by one GET of the size the table records.
    assert counts.requests["GET"] == 2 + threads, counts
