"""Reading many values of a database on an object store in few ranged GETs.

TensorStore's OCDBT reads each value with its own GET: a load of 5,000 small
arrays made about 3,300 requests to S3, at tens of milliseconds each. But the
values of one save sit next to each other in a few data files, and the
b-tree says where (``_ocdbt_index``). So neighbouring values of one file
(gaps of up to ``GAP_BYTES`` are read and dropped) are read as runs, each cut
into ranges of at most ``RANGE_BYTES``; ``requests_in_flight`` of them at
once, few for a small load (memory) and many for a large one (bandwidth).

TensorStore hands a range to Python as a new ``bytes`` made through a C++
string: two more copies of it, made, copied into the arrays and dropped on
one thread of their own (``_copier``). glibc's malloc gives each thread its
own heap and keeps what a heap frees for reuse: on the event loop's thread
those copies landed among the arrays' buffers, and each range touched fresh
pages; on their own thread each range reuses the last one's memory.

A value a range did not fully deliver is ``None``: the caller reads it
through TensorStore, which reports what is wrong.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
from collections.abc import Sequence
from typing import Any

import attrs
import checkpointables as cp
import numpy as np

from checkpointables_pytree.ocdbt import DatabaseIndex, ValueLocation
from checkpointables_pytree.storage import Slab

__all__ = ["read_values"]

# A request costs what tens of milliseconds of transfer would: read through gaps this small.
GAP_BYTES = 1 << 20
# A load holds its ranges in flight beside its arrays, about three times over: in TensorStore's
# HTTP threads, then as the string and the bytes made on _copier, and each of those threads
# keeps about as much freed memory for reuse. Peak RSS growth loading 256 MiB of jax.Arrays in
# the s3-256mib benchmark case, and its GETs: 4 x 8 MiB 1.38-1.47x (1.40x with _copier), 52;
# 4 x 4 MiB with _copier 1.07-1.21x, 85; 2 x 8 MiB with _copier 1.10x, 52, as fast as 4 x 8
# MiB. So a load keeps at most 1/IN_FLIGHT_SHARE of its bytes in flight (at least
# MIN_REQUESTS ranges): a large load far from the server still gets the request concurrency
# it needs (32 ranges at 30 ms each for 8 GiB and more). Ranges of 8 MiB also keep a load of
# thousands of small arrays at a few requests (47 MiB in 3,000 arrays: 16 GETs; 24 with 4 MiB).
MIN_REQUESTS = 2
IN_FLIGHT_SHARE = 32
DEFAULT_CONCURRENCY = 32  # TensorStore's s3_request_concurrency and gcs_request_concurrency.
RANGE_BYTES = 8 << 20


def requests_in_flight(load_bytes: int) -> int:
    """How many ranges a load of ``load_bytes`` keeps in flight.

    At most the request concurrency of the ``cp.options.StorageOptions`` in force (default
    32), at least ``MIN_REQUESTS``, and otherwise ``1 / IN_FLIGHT_SHARE`` of the load's bytes.
    For example 2 for 256 MiB, 4 for 1 GiB, 32 for 8 GiB and more.
    """
    concurrency = cp.context.get_context().storage_options.request_concurrency
    by_memory = max(MIN_REQUESTS, load_bytes // (IN_FLIGHT_SHARE * RANGE_BYTES))
    return min(concurrency or DEFAULT_CONCURRENCY, by_memory)


@attrs.define
class _Run:
    """Neighbouring values of one file, read as consecutive ranges."""

    file: str
    start: int
    end: int
    members: list[int]  # Indices into the locations, by offset.


async def read_values(
    index: DatabaseIndex, locations: Sequence[ValueLocation | None], limit: asyncio.Semaphore
) -> list[np.ndarray | None]:
    """The bytes at each location (``None`` in, ``None`` out), each in a 64-byte aligned buffer.

    ``limit`` (of ``requests_in_flight``, shared by a load's calls) bounds the requests in flight.
    """
    base = await index.base()
    order = sorted(
        (i for i, loc in enumerate(locations) if loc is not None),
        key=lambda i: locations[i][:2],  # type: ignore[index]
    )
    slab = Slab([locations[i].length for i in order])  # type: ignore[union-attr]
    buffers: list[np.ndarray | None] = [None] * len(locations)
    for i in order:
        buffers[i] = slab.take(locations[i].length)  # type: ignore[union-attr]
    missing = [False] * len(locations)
    tasks = []
    for run in _runs(order, locations):
        run.file = os.path.relpath(run.file, index.root)  # Keys of the directory's kvstore.
        for start in range(run.start, run.end, RANGE_BYTES):
            end = min(run.end, start + RANGE_BYTES)
            read = _read_range(base, run, start, end, locations, buffers, missing, limit)
            tasks.append(asyncio.ensure_future(read))
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        await asyncio.gather(
            *tasks, return_exceptions=True
        )  # TensorStore futures end on their own.
        raise
    return [None if gone else value for value, gone in zip(buffers, missing, strict=True)]


def _runs(order: Sequence[int], locations: Sequence[ValueLocation | None]) -> list[_Run]:
    runs: list[_Run] = []
    for i in order:
        file, offset, length = locations[i]  # type: ignore[misc]
        if runs and runs[-1].file == file and 0 <= offset - runs[-1].end <= GAP_BYTES:
            runs[-1].end = max(runs[-1].end, offset + length)
            runs[-1].members.append(i)
        else:
            runs.append(_Run(file, offset, offset + length, [i]))
    return runs


async def _read_range(
    base: Any,
    run: _Run,
    start: int,
    end: int,
    locations: Sequence[ValueLocation | None],
    buffers: list[np.ndarray | None],
    missing: list[bool],
    limit: asyncio.Semaphore,
) -> None:
    """Reads ``[start, end)`` of the run's file into the values it overlaps."""
    async with limit:
        try:
            result = await base.read(run.file, byte_range=slice(start, end))
        except ValueError as e:
            if "OUT_OF_RANGE" not in str(e):
                raise
            result = None  # A truncated object: its values are missing, as a short read's.

        def copy() -> None:  # On _copier: see the module's docstring.
            whole = result is not None and result.state == "value"
            data = np.frombuffer(result.value, np.uint8) if whole else None
            for i in run.members:
                _, offset, length = locations[i]  # type: ignore[misc]
                low, high = max(start, offset), min(end, offset + length)
                if low >= high:
                    continue
                if data is None or len(data) < high - start:
                    missing[i] = True  # Cut short: TensorStore's read reports it.
                    continue
                buffers[i][low - offset : high - offset] = data[low - start : high - start]  # type: ignore[index]

        await asyncio.get_running_loop().run_in_executor(_copier(os.getpid()), copy)


@functools.cache
def _copier(pid: int) -> concurrent.futures.ThreadPoolExecutor:
    """The thread that copies ranges into arrays: one per process (a forked child, its own)."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpointables-ranges")
