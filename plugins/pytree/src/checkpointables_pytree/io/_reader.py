"""The reader: every array of one load, read in one ``Reader.run``.

Leaf handlers ``add_all`` an ``ArrayRead`` per leaf; ``run`` then takes one of
two paths per array:

* ``_read_whole``: arrays whose layout ``_METADATA`` recorded, uncompressed
  with one inner chunk per shard (what this library writes), wanted whole.
  Their shards are read as plain values and checked here against zarr3's
  own CRC-32C (hardware CRC-32C, ``crc32c``), in groups of about
  ``GROUP_BYTES`` on worker threads. Small one-shard arrays of a local
  database are read and checked many at a time by ``_small_reads``.
  Values come from ``_local_reads`` (local files, ``preadv`` into the
  arrays' memory) or ``_remote_reads`` (object stores, few ranged GETs),
  located by the b-tree
  (``_ocdbt_index``); TensorStore's kvstore reads the rest (small trees,
  inline values, anything the fast paths cannot vouch for).
* ``_read_with_driver``: everything else (Orbax's checkpoints, compressed
  arrays, a part of a large array) through TensorStore's zarr3 driver,
  which checks the CRC-32C itself; at most ``IN_FLIGHT_BYTES`` are decoded
  at once.

Under a host-memory budget (``_run_within``) small arrays take those paths a
window at a time, and large ones are streamed onto their devices, several at
once under one limit: by ``_ranged_reads`` (byte ranges of the chunks, where
this library wrote them and the b-tree locates them) or by
``_streamed_reads`` (the driver).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import operator
import os
import struct
from collections.abc import Iterable, Sequence
from typing import Any, cast

import checkpointables as cp
import crc32c
import numpy as np
import tensorstore as ts
from checkpointables import execution
from etils import epath

from checkpointables_pytree import ocdbt as ocdbt_room
from checkpointables_pytree import storage
from checkpointables_pytree import zarr3 as zarr3_room
from checkpointables_pytree.io import _ranged_reads, _remote_reads, _small_reads, _streamed_reads
from checkpointables_pytree.io._array_reads import (
    ArrayRead,
    Region,
    StoredArray,
    assemble,
    check_against_metadata,
    check_fits_in_memory,
    check_shape,
    convert_all,
    open_stored,
    pieces_of,
    read_region,
    region_shape,
    regions_of,
    tiling_box,
    within,
)
from checkpointables_pytree.storage import ByteLimiter, gather_settled, settle

__all__ = ["Reader", "read_values"]

_recorded_crc = struct.Struct("<I").unpack_from  # A shard's CRC-32C follows its data.
_trailer = zarr3_room.shard_trailer
_Keyed = tuple[ArrayRead, tuple[bytes, ...]]  # A read and the keys of its shards.
_NBYTES = operator.attrgetter("stored.nbytes")  # Of a read's stored array.

# Large arrays being decoded by the zarr3 driver at once: bounds the extra memory of a load.
IN_FLIGHT_BYTES = 128 << 20
# Without a budget, arrays this library wrote of at least UNBOUNDED_STREAM_BYTES, loaded
# through a sink, are read as byte ranges straight into their regions, as under a budget:
# read whole, a sharded or many-chunk array is held on the host twice (the stored bytes, then
# the regions cut from them), and is slower for the page faults of the second copy. Pieces of
# UNBOUNDED_PIECE, at most UNBOUNDED_LIMIT bytes of them in flight (as a budget of 32 MiB):
# only pieces that are not one block of a region (resharding) are held besides the state,
# and larger ones (32 MiB, 128 MiB in flight) were no faster (docs/memory.md, Measured).
UNBOUNDED_STREAM_BYTES = 4 << 20
UNBOUNDED_PIECE = 4 << 20
UNBOUNDED_LIMIT = 16 << 20
# On an object store each piece is a request, whose latency small pieces would pay many
# times over: pieces of a ranged GET's size (``_remote_reads.RANGE_BYTES``), 8 in flight.
REMOTE_UNBOUNDED_PIECE = _remote_reads.RANGE_BYTES
REMOTE_UNBOUNDED_LIMIT = 8 * _remote_reads.RANGE_BYTES
# Bytes of arrays per group of whole reads (a larger array is a group of its own): a
# group is read, checked and converted by one worker thread, and several per thread
# even out their ends.
GROUP_BYTES = 16 << 20
MIN_GROUP_BYTES = 1 << 20
GROUPS_PER_THREAD = 4
# Copying from the page cache and checksumming release the GIL but keep a core busy:
# more threads than cores only contend.
READ_THREADS = max(2, os.cpu_count() or 2)
# Up to this many keys, a tree's values are read through TensorStore (walking the b-tree
# costs more); its reads are waited for on the event loop's thread. Arrays larger than
# LARGE_ARRAY_BYTES are read from the files all the same: TensorStore hands them over as
# fresh bytes objects, one more copy.
INLINE_READ_KEYS = 64
LARGE_ARRAY_BYTES = 256 << 10
# Groups up to this size are checked on the event loop's thread (a hand-over costs more).
INLINE_CHECK_BYTES = 1 << 20


async def read_values(kvstore: ts.KvStore, keys: Sequence[str]) -> list[bytes]:
    """The values of many keys (``b""`` for a missing key), read in one TensorStore batch.

    Awaiting each future from the event loop would cost a thread wake-up per
    key; one worker thread collects them all instead.
    """
    with ts.Batch() as batch:
        futures = [kvstore.read(key, batch=batch) for key in keys]
    if len(keys) <= INLINE_READ_KEYS:
        # A few reads of a tiny tree: waiting here is cheaper than a hand-over to a thread.
        return [f.result().value for f in futures]
    return await asyncio.to_thread(lambda: [f.result().value for f in futures])


class Reader:
    """Collects the arrays of one load, then reads them all (``run``)."""

    def __init__(
        self,
        directory: epath.Path,
        *,
        ocdbt: bool = True,
        zarr3: bool = True,
        verify: bool = True,
        opened: ocdbt_room.OpenedDatabase | None = None,
        cross_check: bool = False,
        fast_path: bool = True,
        index: ocdbt_room.DatabaseIndex | None = None,
        host_bytes: int | None = None,
    ) -> None:
        """A reader of the arrays in ``directory``.

        ``fast_path``: locate values with our own b-tree index and read them from
        the files ourselves; ``False`` leaves every key to TensorStore's kvstore
        (read in batches) and zarr3 driver. ``index``: the load's index of the
        database, if it made one (``opened``'s otherwise, or a new one).
        ``host_bytes``: the host-memory budget (``cp.options.MemoryOptions``);
        ``None``: every array is read at once.
        """
        self._host_bytes = host_bytes
        self._directory = directory
        self._opened = opened if ocdbt and fast_path else None
        self._cross_check = cross_check
        self._ocdbt = ocdbt
        self._zarr3 = zarr3
        self._local = ocdbt_room.is_local(directory)
        # False skips the CRC-32Cs checked here (the zarr3 driver always checks its own).
        self._verify = verify
        self._reads: list[ArrayRead] = []
        self._index = self._opened.index if self._opened is not None else None
        if self._index is None and ocdbt and fast_path:
            self._index = index
        if self._index is None and ocdbt and fast_path:
            self._index = ocdbt_room.DatabaseIndex(directory)

    def array_spec(self, name: str) -> dict[str, Any]:
        """The zarr spec of array ``name`` (for the driver)."""
        if self._ocdbt:
            kvstore: Any = ocdbt_room.kvstore_spec(
                self._directory, path=zarr3_room.array_prefix(name)
            )
        else:  # Orbax's use_ocdbt=False layout: one directory per array.
            kvstore = ocdbt_room.location_spec(storage.array_directory(self._directory, name))
        return {"driver": "zarr3" if self._zarr3 else "zarr", "kvstore": kvstore}

    def add_all(self, reads: Sequence[ArrayRead]) -> None:
        """Schedules ``reads``; each ``read.result`` is set by ``run``.

        Raises:
          cp.errors.TreeMismatchError: a recorded shape differs from the target's.
        """
        for read in reads:
            stored, target = read.stored, read.target_shape
            if target is not None and stored is not None and tuple(target) != stored.shape:
                check_shape(read, stored.shape)  # Fail before any read, when possible.
        self._reads += reads

    async def run(self) -> None:
        """Reads every scheduled array and converts it."""
        if not self._reads:
            return
        context = self._opened.context if self._opened is not None else ocdbt_room.make_context()
        if self._host_bytes is not None:
            await self._run_within(context, self._host_bytes)
        else:
            await self._run_unbounded(context)

    async def _run_unbounded(self, context: ts.Context) -> None:
        """Reads without a budget: every array at once, the large ones this library wrote
        (or this process's part of them) as byte ranges straight into their regions
        (``_ranged_reads``), the rest whole or through the driver."""
        large = [r for r in self._reads if _streams_unbounded(r)] if self._index else []
        if not large:
            await self._read_all(self._reads, context, IN_FLIGHT_BYTES)
            return
        found = await self._locate_streamed(large, context)
        ranged = {id(r) for r in large if self._plan(r, found) is not None}
        rest = [r for r in self._reads if id(r) not in ranged]
        streamed = [r for r in large if id(r) in ranged]
        limit, piece = (
            (UNBOUNDED_LIMIT, UNBOUNDED_PIECE)
            if self._local
            else (REMOTE_UNBOUNDED_LIMIT, REMOTE_UNBOUNDED_PIECE)
        )
        tasks = [
            asyncio.ensure_future(self._read_all(rest, context, IN_FLIGHT_BYTES)),
            asyncio.ensure_future(self._stream_all(streamed, context, found, limit, piece)),
        ]
        await gather_settled(tasks)

    async def _run_within(self, context: ts.Context, host_bytes: int) -> None:
        """Reads under a budget: the small arrays a window at a time, then the large ones
        streamed piece by piece onto their devices, several arrays at once."""
        most = _streamed_reads.piece_bytes(host_bytes)
        streamed: list[ArrayRead] = []
        rest: list[ArrayRead] = []
        ranged = self._index is not None  # Arrays stored directly can be read as ranges.
        for read in self._reads:
            streams = _streamed_reads.streams(read, most, ranged=ranged)
            (streamed if streams else rest).append(read)
        window = _streamed_reads.window_bytes(host_bytes)
        for batch in _streamed_reads.in_windows(rest, window):
            await self._read_all(batch, context, window)
            await asyncio.to_thread(storage.give_back_free_memory)
        if not streamed:
            return
        found = await self._locate_streamed(streamed, context)
        # One limit for every piece in flight, of every streamed array.
        await self._stream_all(streamed, context, found, host_bytes // 2, most)

    def _plan(
        self, read: ArrayRead, found: dict[bytes, Any]
    ) -> tuple[list[Region], list[Any]] | None:
        """The regions and located chunks of a ranged read of ``read`` (``None``: the
        driver or the whole-read path reads it)."""
        if read.stored is None:
            return None
        regions = regions_of(read, check_shape(read, read.stored.shape))
        chunks = _ranged_reads.plan(read, regions, found)
        return None if chunks is None else (regions, chunks)

    async def _stream_all(
        self,
        streamed: Sequence[ArrayRead],
        context: ts.Context,
        found: dict[bytes, bytes | ocdbt_room.ValueLocation],
        limit: int,
        most: int,
    ) -> None:
        """Streams ``streamed`` onto their sinks in pieces of at most ``most`` bytes, at
        most ``limit`` bytes in flight: as byte ranges where ``found`` locates their chunks,
        else through the driver."""
        if not streamed:
            return
        limiter = ByteLimiter(limit)
        source = (
            None if self._index is None else _ranged_reads.RangeSource(self._index, self._local)
        )
        shared = _ranged_reads.Shared(limiter, limit, most)

        async def one(read: ArrayRead) -> None:
            planned = None if source is None else self._plan(read, found)
            if planned is not None:
                assert source is not None
                regions, chunks = planned
                await _ranged_reads.stream_ranges(
                    read, regions, chunks, source, shared, verify=self._verify
                )
                return
            spec = self.array_spec(read.name)
            await _streamed_reads.stream(read, spec, context, limiter, most, self._directory)

        tasks = [asyncio.ensure_future(one(read)) for read in streamed]
        try:
            await gather_settled(tasks)
        finally:
            if source is not None:
                source.close()
            await asyncio.to_thread(storage.give_back_free_memory)

    async def _locate_streamed(
        self, reads: Sequence[ArrayRead], context: ts.Context
    ) -> dict[bytes, bytes | ocdbt_room.ValueLocation]:
        """Where the chunks of the streamed arrays stored directly are (``{}``: none found,
        or no index: the driver reads them)."""
        direct = [r for r in reads if r.stored is not None and r.stored.direct]
        if self._index is None or not direct:
            return {}
        if self._cross_check:
            await self._check_zarr_json(await self._kvstore(context), direct)
        try:
            return await self._index.find([k for r in direct for k in r.chunk_keys])
        except ValueError:  # An index TensorStore cannot decode: its reads report the damage.
            return {}

    async def _read_all(
        self, reads: Sequence[ArrayRead], context: ts.Context, in_flight: int
    ) -> None:
        """Reads ``reads`` at once (the driver's at most ``in_flight`` bytes at a time)."""
        whole: list[ArrayRead] = []
        driver: list[ArrayRead] = []
        for read in reads:
            (whole if read.whole and self._ocdbt else driver).append(read)
        limiter = ByteLimiter(in_flight)
        tasks = [asyncio.ensure_future(self._read_with_driver(r, context, limiter)) for r in driver]
        try:
            if whole:
                await self._read_whole(whole, context)
            await asyncio.gather(*tasks)
        except BaseException:
            await settle(tasks)
            raise

    async def _kvstore(self, context: ts.Context) -> ts.KvStore:
        if self._opened is not None:
            return self._opened.kvstore
        try:
            return await ocdbt_room.open_kvstore(self._directory, context)
        except ValueError as e:
            raise storage.storage_error(f"the arrays of {self._directory}", e) from e

    async def _read_whole(self, reads: Sequence[ArrayRead], context: ts.Context) -> None:
        """Reads, checks and converts arrays stored as plain shards, group by group."""
        largest = max(reads, key=_NBYTES)
        check_fits_in_memory(largest, _NBYTES(largest))
        kvstore = await self._kvstore(context)
        if self._cross_check:
            await self._check_zarr_json(kvstore, reads)
        keys = [r.chunk_keys for r in reads]
        found = await self._locate([k for read_keys in keys for k in read_keys], _NBYTES(largest))
        if self._local:
            small, pairs = _small_reads.split(reads, keys, found)
        else:
            small, pairs = [], list(zip(reads, keys, strict=True))
        groups: list[Any] = read_groups(pairs, found, READ_THREADS)
        groups += _small_groups(small, READ_THREADS)
        threads = asyncio.Semaphore(READ_THREADS)
        # Ranged GETs in flight, sized by the load's bytes (object stores only: a sum per leaf).
        in_flight = (
            1 if self._local else _remote_reads.requests_in_flight(_nbytes(r for r, _ in pairs))
        )
        requests = asyncio.Semaphore(in_flight)
        files = storage.OpenFiles()

        async def one(group: list[Any]) -> None:
            async with threads if self._local else contextlib.nullcontext():
                if type(group[0]) is _small_reads.Small:
                    if await asyncio.to_thread(self._finish_small, group, files):
                        return
                    group = [(s.read, s.read.chunk_keys) for s in group]  # TensorStore reads.
                values = await self._fetch(kvstore, group, found, requests, files)
                if sum(r.stored.nbytes for r, _ in group) <= INLINE_CHECK_BYTES:  # type: ignore[union-attr]
                    self._finish(group, values)
                else:
                    await asyncio.to_thread(self._finish, group, values)

        tasks = [asyncio.ensure_future(one(g)) for g in groups if g]
        try:
            await gather_settled(tasks)
        finally:
            files.close()

    def _finish_small(self, group: list[_small_reads.Small], files: storage.OpenFiles) -> bool:
        """Reads, checks and converts a group of small arrays; ``False`` if a file fell short."""
        with execution.paused_gc():
            arrays = _small_reads.read_small(files, group, self._verify)
            if arrays is None:
                return False
            convert_all([(s.read, [a]) for s, a in zip(group, arrays, strict=True)])
            return True

    async def _locate(
        self, keys: Sequence[bytes], largest: int
    ) -> dict[bytes, bytes | ocdbt_room.ValueLocation]:
        """Inline values and value locations from the b-tree: ``{}`` where not worth it
        (``largest``: the bytes of the largest array read)."""
        if self._index is None or (
            self._local and len(keys) <= INLINE_READ_KEYS and largest <= LARGE_ARRAY_BYTES
        ):
            return {}
        try:
            return await self._index.find(keys)
        except ValueError:  # An index TensorStore cannot decode: its reads report the damage.
            return {}

    async def _fetch(
        self,
        kvstore: ts.KvStore,
        group: Sequence[_Keyed],
        found: dict[bytes, Any],
        requests: asyncio.Semaphore,
        files: storage.OpenFiles,
    ) -> list[Any]:
        """The shard values of ``group``, in order: the fast paths', then TensorStore's."""
        values: list[Any] = []
        get, location = found.get, ocdbt_room.ValueLocation
        for read, keys in group:
            size = read.stored.chunk_nbytes + zarr3_room.SHARD_TRAILER_BYTES  # type: ignore[union-attr]
            for key in keys:
                value = get(key)
                # Only values of the size recorded are read here: a damaged b-tree may claim
                # terabytes (TensorStore reads the others, and reports them).
                values.append(None if type(value) is location and value.length != size else value)
        located = [v if type(v) is location else None for v in values]
        if any(located):
            assert self._index is not None
            fetched: Sequence[memoryview | np.ndarray | None]
            if self._local:
                fetched = await asyncio.to_thread(storage.read_values, files, located)
            else:
                fetched = await _remote_reads.read_values(self._index, located, requests)
            values = [v if r is None else r for v, r in zip(values, fetched, strict=True)]
        values = [None if type(v) is location else v for v in values]
        rest = [i for i, v in enumerate(values) if v is None]
        if rest:
            names = [k.decode() for _, read_keys in group for k in read_keys]
            try:
                found_rest = await read_values(kvstore, [names[i] for i in rest])
            except ValueError:  # A node that fails to decode, a file cut short: name the leaf.
                owners = [r for r, read_keys in group for _ in read_keys]
                found_rest = [await _read_one(kvstore, names[i], owners[i]) for i in rest]
            for i, value in zip(rest, found_rest, strict=True):
                values[i] = value
        return values

    def _finish(self, group: Sequence[_Keyed], values: Sequence[Any]) -> None:
        """Checks every shard of ``group`` against its CRC-32C, assembles and converts."""
        with execution.paused_gc():
            done = []
            position = 0
            for read, keys in group:
                count, stored = len(keys), read.stored
                assert stored is not None
                if stored.single_chunk and read.regions is None and read.target_shape is None:
                    # Most arrays: one shard, wanted whole and as stored.
                    data = self._data(read, values[position], 0)
                    array = np.frombuffer(data, dtype=stored.dtype).reshape(stored.shape)
                    done.append((read, [array]))
                else:
                    chunks = [self._data(read, values[position + n], n) for n in range(count)]
                    done.append((read, pieces_of(read, assemble(read, chunks))))
                position += count
            convert_all(done)

    def _data(self, read: ArrayRead, value: Any, n: int) -> memoryview:
        """The data of the ``n``-th shard value of ``read``, once its layout and CRC-32C check."""
        nbytes = read.stored.chunk_nbytes  # type: ignore[union-attr]
        view = memoryview(value)
        if len(view) != nbytes + zarr3_room.SHARD_TRAILER_BYTES or view[nbytes + 4 :] != _trailer(
            nbytes
        ):
            key = zarr3_room.chunk_key(read.name, read.stored.chunk_indices[n])  # type: ignore[union-attr]
            if not len(view):
                raise storage.missing_chunk_error(read.what, key)
            raise _small_reads.layout_error(read, key)
        data = view[:nbytes]
        if self._verify and crc32c.crc32c(data) != _recorded_crc(view, nbytes)[0]:
            raise _small_reads.checksum_error(read)
        return data

    async def _check_zarr_json(self, kvstore: Any, reads: Sequence[ArrayRead]) -> None:
        """Each array's ``zarr.json`` must be the one written for its recorded layout."""
        try:
            keys = [zarr3_room.array_prefix(r.name) + "zarr.json" for r in reads]
            values = await read_values(kvstore, keys)
        except ValueError as e:
            raise storage.storage_error(f"the arrays of {self._directory}", e) from e
        for read, value in zip(reads, values, strict=True):
            stored = read.stored
            assert stored is not None
            if value != zarr3_room.zarr_json(stored.shape, stored.dtype, stored.chunk_shape):
                _check_parsed_zarr_json(read, value, self._directory)
                raise storage.integrity_error(
                    f"{read.what} (array {read.name!r})",
                    "its zarr.json does not describe the shape and dtype _METADATA records",
                )

    async def _read_with_driver(
        self, read: ArrayRead, context: ts.Context, limiter: ByteLimiter
    ) -> None:
        opened = await open_stored(read, self.array_spec(read.name), context, self._directory)
        store, stored_shape, regions = opened.store, opened.shape, opened.regions
        nbytes = sum(math.prod(region_shape(r)) for r in regions) * opened.dtype.itemsize
        check_fits_in_memory(read, nbytes)
        # The regions of one process's devices usually tile one block: read it once
        # rather than every chunk once per region that touches it.
        box = tiling_box(regions)
        async with limiter.hold(nbytes):
            pieces = [
                await read_region(read, store, region, stored_shape)
                for region in (regions if box is None else [box])
            ]
            if box is not None:
                pieces = [pieces[0][within(region, box)] for region in regions]
            read.result = read.convert(pieces)


async def _read_one(kvstore: ts.KvStore, key: str, read: ArrayRead) -> bytes:
    try:
        return (await kvstore.read(key)).value
    except ValueError as e:
        raise storage.storage_error(f"{read.what} (array {read.name!r})", e) from e


def read_groups(
    pairs: Sequence[_Keyed], found: dict[bytes, Any], threads: int
) -> list[list[_Keyed]]:
    """Reads in the order of their first shard in the files, cut into groups of similar size."""

    def where(pair: _Keyed) -> tuple[int, str, int]:
        location = found.get(pair[1][0]) if pair[1] else None
        if type(location) is ocdbt_room.ValueLocation:
            return (0, location.file, location.offset)
        return (1, "", 0)

    ordered = sorted(pairs, key=where) if found else list(pairs)
    sizes = [r.stored.nbytes for r, _ in ordered]  # type: ignore[union-attr]
    return _small_reads.in_groups(ordered, sizes, _budget(sum(sizes), GROUP_BYTES, threads))


def _small_groups(small: list[_small_reads.Small], threads: int) -> list[list[_small_reads.Small]]:
    """Small reads in groups of similar size, each at most one buffer of ``SLAB_BYTES``."""
    total = sum(s.size for s in small)
    budget = max(_small_reads.MIN_BUFFER_BYTES, _budget(total, storage.SLAB_BYTES, threads))
    return _small_reads.groups(small, budget)


def _budget(total: int, most: int, threads: int) -> int:
    """Bytes per group: several groups per thread, each at least ``MIN_GROUP_BYTES``."""
    return max(MIN_GROUP_BYTES, min(most, total // (GROUPS_PER_THREAD * threads)))


def _streams_unbounded(read: ArrayRead) -> bool:
    """Whether a load without a budget streams ``read`` as byte ranges (where the b-tree
    locates its chunks): stored directly (uncompressed, one inner chunk per shard), at least
    ``UNBOUNDED_STREAM_BYTES``, with a sink. A part of it too (a process's rows of an array
    split across processes): the ranges read only the chunks its regions touch, as the
    driver would, but in bounded pieces, without the driver's whole-chunk copies."""
    stored = read.stored
    return (
        read.sink is not None
        and stored is not None
        and stored.direct
        and stored.nbytes >= UNBOUNDED_STREAM_BYTES
    )


def _nbytes(reads: Iterable[ArrayRead]) -> int:
    return sum(cast(StoredArray, r.stored).nbytes for r in reads)  # Every one recorded.


def _check_parsed_zarr_json(read: ArrayRead, value: bytes, directory: Any) -> None:
    """Raises ``cp.errors.MetadataError`` if ``value``, the array's ``zarr.json``, records
    another shape or dtype than ``_METADATA`` (a load would refuse it there too)."""
    try:
        document = cp.safe_json.loads_object(value, source="zarr.json")
        shape, dtype, chunks = zarr3_room.zarr_shape_dtype(document)
    except cp.errors.MetadataError:
        return  # Not an array's metadata at all: the caller's IntegrityError says so.
    check_against_metadata(read, shape, dtype, chunks, directory)
