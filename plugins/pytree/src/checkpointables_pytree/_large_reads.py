"""Reading large arrays whose checksums ``_METADATA`` recorded, on one thread per core.

The arrays are split into groups of about ``GROUP_BYTES``, in the order their
bytes lie in the database's files. Each group is one task of the reading
threads: read every array of the group, check it against its recorded
checksum, and convert the group in one batch (``_array_reads.convert_all``:
one ``jax.device_put`` for many arrays). Few, large tasks keep the reading
threads away from the GIL, which the event loop's thread holds meanwhile to
decode the small arrays: a task per array, converted on its own, spent a
third of its time waiting for the GIL.

Shards of a local database are read with ``os.preadv`` straight into the
64-byte aligned memory that becomes the array (``_value_files``; on CPU
``jax.device_put`` aliases it), each data file opened once per load; the
arrays of a group share one buffer (``_buffers.Slab``). Shards
whose location is unknown, and remote databases, are read through
TensorStore's kvstore.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from checkpointables_pytree import _checksums, _errors, _value_files, _zarr3
from checkpointables_pytree._array_reads import ArrayRead, convert_all, pieces_of
from checkpointables_pytree._buffers import Slab, aligned_empty

__all__ = ["GROUP_BYTES", "read_large"]

# Bytes of arrays per task of the reading threads (a larger array is a task of its own),
# lowered so that each thread gets several tasks: the last task decides when a load ends.
GROUP_BYTES = 16 << 20
MIN_GROUP_BYTES = 1 << 20
TASKS_PER_THREAD = 4
# One reading thread per core.
READ_THREADS = max(2, os.cpu_count() or 2)
# Large values read through TensorStore's kvstore: ranges of this size, this many at once.
RANGE_BYTES = 8 << 20
RANGE_WINDOW = 3
# Reading through the kvstore, shards are first checked to hold the data recorded when
# an array claims more than this (smaller buffers are allocated on trust).
UNCHECKED_ALLOCATION_BYTES = 256 << 20
# On an object store the threads mostly wait for requests: many of them keep up to
# REMOTE_READ_THREADS * REMOTE_RANGE_WINDOW requests in flight, holding at most 256 MiB.
# A 256 MiB load from a local S3 server took 1.96x as long as 256 parallel GETs with the
# 2 local threads (6 requests in flight), 1.49x with 16 threads and 1.17x with 32.
REMOTE_READ_THREADS = 32
REMOTE_RANGE_BYTES = 8 << 20
REMOTE_RANGE_WINDOW = 1


async def read_large(
    kvstore: Any,
    reads: Sequence[ArrayRead],
    *,
    verify: bool,
    locations: dict[str, _value_files.ValueLocation],
    remote: bool = False,
) -> None:
    """Reads, checks and converts ``reads`` in the reading threads; sets each ``result``.

    ``locations`` says where the shards of a local database are (empty: read
    everything through ``kvstore``); ``remote``: the database is on an object
    store. Raises the first error of any read.
    """
    pool = _remote_read_pool() if remote else _read_pool()
    groups = _groups(reads, locations, REMOTE_READ_THREADS if remote else READ_THREADS)
    files = _OpenFiles()
    window = (REMOTE_RANGE_BYTES, REMOTE_RANGE_WINDOW) if remote else (RANGE_BYTES, RANGE_WINDOW)
    try:
        read_group = functools.partial(
            _read_group, kvstore, verify=verify, locations=locations, files=files, window=window
        )
        await _map_in_pool(pool, read_group, groups)
    finally:
        files.close()


def _groups(
    reads: Sequence[ArrayRead], locations: dict[str, _value_files.ValueLocation], threads: int
) -> list[list[ArrayRead]]:
    """``reads`` in the order of their first shard's location, cut into groups of similar size."""

    def where(read: ArrayRead) -> tuple[int, str, int]:
        stored = read.stored
        assert stored is not None
        location = locations.get(_zarr3.chunk_key(read.name, stored.chunk_indices[0]))
        return (0, location.file, location.offset) if location else (1, "", 0)

    ordered = sorted(reads, key=where)
    total = sum(r.stored.nbytes for r in ordered)  # type: ignore[union-attr]
    budget = max(MIN_GROUP_BYTES, min(GROUP_BYTES, total // (TASKS_PER_THREAD * threads)))
    groups: list[list[ArrayRead]] = [[]]
    used = 0
    for read in ordered:
        if groups[-1] and used >= budget:
            groups.append([])
            used = 0
        groups[-1].append(read)
        used += read.stored.nbytes  # type: ignore[union-attr]
    return [g for g in groups if g]


def _read_group(
    kvstore: Any,
    group: Sequence[ArrayRead],
    *,
    verify: bool,
    locations: dict[str, _value_files.ValueLocation],
    files: _OpenFiles,
    window: tuple[int, int],
) -> None:
    done = []
    # Only sizes the data vouches for are allocated (a damaged _METADATA may claim terabytes).
    local = {id(r) for r in group if _shard_locations(read=r, locations=locations) is not None}
    slab = Slab([r.stored.nbytes for r in group if id(r) in local])  # type: ignore[union-attr]
    for read in group:
        array = _read_local(read, verify, locations, files, slab) if id(read) in local else None
        if array is None:
            array = _read_through_kvstore(kvstore, read, verify, window)
        done.append((read, pieces_of(read, array)))
    convert_all(done)


class _OpenFiles:
    """The data files of one load, each opened once and shared by the reading threads."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def fd(self, path: str) -> int:
        """A descriptor of ``path`` open for reading (raises ``OSError``)."""
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            return fd

    def close(self) -> None:
        """Closes every descriptor; call once no read uses them any more."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


@functools.cache
def _read_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that read and check large arrays, one per core.

    Copying from the page cache and summing release the GIL but keep a core
    busy: more threads than cores only contend (measured: 6 threads read a
    256 MiB tree 20% slower than 2).
    """
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=READ_THREADS, thread_name_prefix="checkpointables-read"
    )


@functools.cache
def _remote_read_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that read large arrays from object stores (mostly waiting for requests)."""
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=REMOTE_READ_THREADS, thread_name_prefix="checkpointables-read-remote"
    )


async def _map_in_pool(
    pool: concurrent.futures.ThreadPoolExecutor,
    function: Callable[[Any], None],
    items: Sequence[Any],
) -> None:
    """Calls ``function`` on every item in ``pool``'s threads; raises the first error.

    One wake-up of this event loop for the lot, rather than one per item.
    """
    futures = [pool.submit(function, item) for item in items]
    try:
        await asyncio.to_thread(
            concurrent.futures.wait, futures, return_when=concurrent.futures.FIRST_EXCEPTION
        )
    finally:  # After an error or a cancellation: drop what has not started, let the rest end.
        for future in futures:
            future.cancel()
        await asyncio.shield(asyncio.to_thread(concurrent.futures.wait, futures))
    for future in futures:
        future.result()


def _read_local(
    read: ArrayRead,
    verify: bool,
    locations: dict[str, _value_files.ValueLocation],
    files: _OpenFiles,
    slab: Slab,
) -> np.ndarray | None:
    """The whole array, read from a local database's files into a 64-byte aligned buffer.

    ``None`` when a shard's location is unknown, cannot be read, or does not
    hold a shard of the recorded size: TensorStore's read then decides what is wrong.
    """
    stored = read.stored
    assert stored is not None and stored.checksums is not None
    dtype, shape = stored.dtype, stored.shape
    nbytes = math.prod(stored.chunk_shape) * dtype.itemsize
    chosen = _shard_locations(read, locations)
    if chosen is None:
        return None
    trailer = _zarr3.shard_trailer(nbytes)
    layout = _zarr3.ZarrLayout(read.name, shape, dtype, stored.chunk_shape)
    flat = slab.take(stored.nbytes)
    full = flat.view(dtype).reshape(shape)
    # Chunks that split only the first axis are contiguous runs of the array's
    # bytes: they are read in place, only their edge padding goes elsewhere.
    rows = len(shape) > 0 and stored.chunk_shape[1:] == shape[1:]
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    scratch = None if rows else aligned_empty(nbytes)
    kind = stored.checksum_kind if verify else None
    for n, (index, location) in enumerate(zip(stored.chunk_indices, chosen, strict=True)):
        assert location is not None
        region = layout.region(index)
        if scratch is None:
            start = region[0].start * row_bytes
            valid = (region[0].stop - region[0].start) * row_bytes
            parts = [memoryview(flat[start : start + valid])]
            if valid < nbytes:
                parts.append(memoryview(np.empty(nbytes - valid, dtype=np.uint8)))
        else:
            parts = [memoryview(scratch)]
        try:
            digest, rest = _value_files.read_checked(files.fd(location.file), location, parts, kind)
        except (OSError, EOFError):
            return None
        if rest[4:] != trailer:  # After the data's CRC-32C: the shard index.
            return None
        if verify and digest != stored.checksums[n]:
            raise _errors.integrity_error(read.what, "a chunk's checksum does not match its data")
        if scratch is not None:
            chunk = scratch.view(dtype).reshape(stored.chunk_shape)
            full[region] = chunk[tuple(slice(0, r.stop - r.start) for r in region)]
    return full


def _shard_locations(
    read: ArrayRead, locations: dict[str, _value_files.ValueLocation]
) -> list[_value_files.ValueLocation] | None:
    """Where each shard of ``read`` is, if every one is known and of the size recorded."""
    stored = read.stored
    assert stored is not None
    if not locations:
        return None
    expected = math.prod(stored.chunk_shape) * stored.dtype.itemsize + _zarr3.SHARD_TRAILER_BYTES
    found = []
    for index in stored.chunk_indices:
        location = locations.get(_zarr3.chunk_key(read.name, index))
        if location is None or location.length != expected:
            return None
        found.append(location)
    return found


def _check_shard_sizes(kvstore: Any, read: ArrayRead, keys: Sequence[str], nbytes: int) -> None:
    """Checks that the shards ``keys`` hold ``nbytes`` of data each (their indexes, read
    alone, say so) before buffers for them are allocated: a damaged ``_METADATA`` may
    claim terabytes. Only for claims above ``UNCHECKED_ALLOCATION_BYTES``, which cost
    one more round trip to the storage (all shards' at once)."""
    if nbytes * len(keys) <= UNCHECKED_ALLOCATION_BYTES:
        return
    end = nbytes + _zarr3.SHARD_TRAILER_BYTES
    try:
        futures = [kvstore.read(key, byte_range=slice(nbytes, end)) for key in keys]
        tails = [f.result().value for f in futures]
    except Exception as e:
        raise _errors.storage_error(f"{read.what} (array {read.name!r})", e) from e
    trailer = _zarr3.shard_trailer(nbytes)
    for key, tail in zip(keys, tails, strict=True):
        if len(tail) != _zarr3.SHARD_TRAILER_BYTES or tail[4:] != trailer:
            raise _errors.integrity_error(
                read.what, f"chunk {key} does not hold the {nbytes:,} bytes _METADATA records"
            )


def _read_through_kvstore(
    kvstore: Any, read: ArrayRead, verify: bool, window: tuple[int, int]
) -> np.ndarray:
    """The whole array, its shards read through TensorStore's kvstore and checked here."""
    stored = read.stored
    assert stored is not None and stored.checksums is not None
    nbytes = math.prod(stored.chunk_shape) * stored.dtype.itemsize
    trailer = _zarr3.shard_trailer(nbytes)
    single = stored.chunk_shape == stored.shape
    keys = [_zarr3.chunk_key(read.name, index) for index in stored.chunk_indices]
    _check_shard_sizes(kvstore, read, keys, nbytes)
    full = None if single else np.empty(stored.shape, dtype=stored.dtype)
    chunk = None
    for n, (index, key) in enumerate(zip(stored.chunk_indices, keys, strict=True)):
        # data, its CRC-32C, the shard index and its CRC-32C
        buffer = aligned_empty(nbytes + _zarr3.SHARD_TRAILER_BYTES)
        try:
            got = _read_value_into(kvstore, key, buffer, *window)
        except Exception as e:
            raise _errors.storage_error(f"{read.what} (array {read.name!r})", e) from e
        if got != nbytes + _zarr3.SHARD_TRAILER_BYTES or buffer[nbytes + 4 :].tobytes() != trailer:
            problem = "is missing" if not got else "does not have the layout that was written"
            raise _errors.integrity_error(read.what, f"chunk {key} {problem}")
        data = buffer[:nbytes]
        if verify and _checksums.checksum(stored.checksum_kind, data) != stored.checksums[n]:
            raise _errors.integrity_error(read.what, "a chunk's checksum does not match its data")
        chunk = data.view(stored.dtype).reshape(stored.chunk_shape)
        if full is not None:
            layout = _zarr3.ZarrLayout(read.name, stored.shape, stored.dtype, stored.chunk_shape)
            region = layout.region(index)
            full[region] = chunk[tuple(slice(0, r.stop - r.start) for r in region)]
    array = full if full is not None else chunk
    assert array is not None
    return array


def _read_value_into(
    kvstore: Any, key: str, buffer: np.ndarray, range_bytes: int, range_window: int
) -> int:
    """Reads a value into ``buffer`` with a sliding window of ``range_window`` parallel reads
    of ``range_bytes``.

    Parallel ranges cut the latency of one large read several times; the
    window bounds the memory in flight. Returns the number of bytes read.
    """
    total = len(buffer)
    starts = iter(range(0, total, range_bytes))
    pending: collections.deque[tuple[int, Any]] = collections.deque()

    def submit() -> None:
        start = next(starts, None)
        if start is not None:
            end = min(total, start + range_bytes)
            pending.append((start, kvstore.read(key, byte_range=slice(start, end))))

    for _ in range(range_window):
        submit()
    read = 0
    while pending:
        start, future = pending.popleft()
        value = future.result().value
        if not value:
            return read
        buffer[start : start + len(value)] = np.frombuffer(value, dtype=np.uint8)
        read += len(value)
        del value
        submit()
    return read
