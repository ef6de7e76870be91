"""Array I/O for one pytree directory: a TensorStore OCDBT database of zarr3 arrays.

Opening a zarr3 driver costs about 150 us of Python per array, which dominates
trees of many small arrays. So arrays are split by size:

* small arrays (up to ``DIRECT_WRITE_BYTES``) are encoded here into the exact
  zarr3 keys the driver would write (``<name>/zarr.json`` and one shard per
  chunk, see ``_zarr3``) and written through one OCDBT kvstore in a few large
  transactions; their checksums are computed in one batch;
* large arrays are written through TensorStore's zarr3 driver, in groups
  committed by several OCDBT writers, with their ``zarr.json`` batched with
  the small arrays' keys; loads read them back as raw values checked against
  their recorded checksums (``_large_reads``), or through the driver (at most
  ``IN_FLIGHT_BYTES`` being decoded at once) when none were recorded or only
  part of an array is wanted.

Everything of one save or load shares one ``ts.Context``, so every handle on
the database shares its caches and its writer.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import os
import zlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import checkpointables as cp
import numpy as np
import tensorstore as ts
from checkpointables import execution
from etils import epath

from checkpointables_pytree import (
    _checksums,
    _crc32c,
    _errors,
    _large_reads,
    _local_values,
    _object_store,
    _remote_values,
    _ts_futures,
    _value_files,
    _zarr3,
)
from checkpointables_pytree._array_reads import (
    SMALL_ARRAY_BYTES,
    ArrayRead,
    Region,
    StoredArray,
    check_shape,
    convert_all,
    intersect,
    pieces_of,
    region_shape,
    regions_of,
)
from checkpointables_pytree._tree_metadata import METADATA_FILE

__all__ = [
    "DIRECT_WRITE_BYTES",
    "SMALL_ARRAY_BYTES",
    "ArrayWrite",
    "ArrayWriter",
    "ArrayRead",
    "ArrayReader",
    "StoredArray",
    "make_context",
    "kvstore_spec",
    "database_directory",
]

# Arrays up to this size are encoded here (larger ones by the zarr3 driver). Encoding
# copies each byte three times and checksums it twice; the driver costs a fixed
# ~100 us per chunk instead. 128 MiB of 128 KiB arrays saved in 325 ms encoded here
# and 206 ms through the driver; of 64 KiB arrays, 327 and 337 ms; of 32 KiB
# arrays, 399 and 562 ms. (Loads read arrays up to SMALL_ARRAY_BYTES directly
# either way: that stays faster up to 256 KiB.)
DIRECT_WRITE_BYTES = 64 << 10
# Small arrays per transaction: bounds the memory a batch of encoded keys takes.
SMALL_BATCH_BYTES = 32 << 20
# Batches of small arrays being checksummed while one is encoded (more only contend for the GIL).
PREPARED_AHEAD = 1
# Large arrays being encoded/decoded at once: bounds the extra memory of a save or load.
IN_FLIGHT_BYTES = 128 << 20
# Arrays written through the driver are grouped into transactions of at most this
# many bytes (one commit each); a larger array is written alone.
LARGE_GROUP_BYTES = 32 << 20
# Groups are committed by this many OCDBT writers (databases of their own, merged
# into the pytree's at the end). One writer commits one transaction at a time and
# writes its data file on one thread: with one writer a 256 MiB save waited for
# those writes, and the disk sat idle until the first commit ended.
WRITERS = 4
# On an object store each commit waits for several requests (tens of ms each) besides its
# data PUT: more writers keep more PUTs in flight (see docs/performance.md, "Object stores").
REMOTE_WRITERS = 16
# Up to this many keys, read_values waits for them on the event loop's thread.
INLINE_READ_KEYS = 64
# A _METADATA of more than this (about 100 leaves) starts a load's index early.
PREFETCH_METADATA_BYTES = 32 << 10
# Up to this many bytes, the recorded CRC-32s are computed on the event loop's thread.
INLINE_CHECKSUM_BYTES = 1 << 20
MANIFEST_FILE = "manifest.ocdbt"
WRITER_PREFIX = "ocdbt.writer_"
OCDBT_CONFIG = {"max_inline_value_bytes": 1024, "max_decoded_node_bytes": 100_000_000}


# B-tree nodes are read by every key lookup of a load: cached.
OCDBT_CACHE_BYTES = 100_000_000
# A save's commits only re-read the nodes they change. With the load's cache, a save
# of 40,000 small arrays (147 MB) peaked 60 to 90 MB higher, and was no faster.
SAVE_OCDBT_CACHE_BYTES = 8 << 20


def make_context(ocdbt_cache_bytes: int = OCDBT_CACHE_BYTES) -> ts.Context:
    """A TensorStore context for one save or load."""
    return ts.Context(
        {
            # Object stores: the request concurrency and retries of cp.options.StorageOptions.
            **_object_store.context_resources(),
            "file_io_concurrency": {"limit": 128},
            # Files are flushed once, by the commit that fsyncs the whole checkpoint.
            "file_io_sync": False,
            # Array chunks are read once: caching them would only double memory.
            "cache_pool": {"total_bytes_limit": 0},
            "cache_pool#ocdbt": {"total_bytes_limit": ocdbt_cache_bytes},
        }
    )


def _base(directory: epath.PathLike) -> Any:
    text = os.fspath(directory)
    if "://" in text:  # s3://..., gs://...: configured as cp.options.StorageOptions says.
        return _object_store.kvstore_spec(text)
    return {"driver": "file", "path": text}


def kvstore_spec(
    database: epath.PathLike, *, path: str | None = None, create: bool = False
) -> dict[str, Any]:
    """The spec of the OCDBT kvstore rooted at ``database`` (optionally at ``path`` in it)."""
    spec: dict[str, Any] = {
        "driver": "ocdbt",
        "base": _base(database),
        "cache_pool": "cache_pool#ocdbt",
    }
    if create:
        spec["config"] = dict(OCDBT_CONFIG)
    if path is not None:
        spec["path"] = path
    return spec


def database_directory(pytree_directory: epath.Path) -> epath.Path:
    """Where this process writes arrays.

    One process writes straight into the pytree directory's database. In a
    multi-process save each process writes its own ``ocdbt.process_<i>``
    database, which the primary host merges into the root at commit (as
    Orbax does), so that no two processes ever write one manifest.
    """
    if cp.multihost.process_count() == 1:
        return pytree_directory
    return pytree_directory / f"ocdbt.process_{cp.multihost.process_index()}"


class OpenedDatabase:
    """A load's TensorStore context and OCDBT kvstore, opened before ``_METADATA`` is parsed.

    ``start`` also issues one read, which brings the manifest and the b-tree's
    root into the context's cache while this thread parses the metadata and
    plans the reads: for a tree of a few leaves that waiting was a fifth of
    the load. For a tree of many leaves (a ``_METADATA`` of more than
    ``PREFETCH_METADATA_BYTES``) it also starts reading where the values are
    (``index``), which TensorStore decodes meanwhile in its own threads.
    """

    def __init__(
        self, directory: epath.Path, context: ts.Context, kvstore: ts.KvStore, warming: Any
    ) -> None:
        self.context = context
        self.kvstore = kvstore
        # Where values are, for reads that bypass TensorStore (see ``_value_files``).
        self.index = _value_files.DatabaseIndex(directory)
        self._warming = warming  # Held: TensorStore may cancel a read whose future is dropped.

    @classmethod
    def start(cls, directory: epath.Path) -> OpenedDatabase | None:
        """Opens the local OCDBT database in ``directory``; ``None`` if there is none.

        Anything unusual is left to the reads, which report it.
        """
        if not _value_files.is_local(directory):
            return None
        if not os.path.exists(os.path.join(os.fspath(directory), MANIFEST_FILE)):
            return None
        context = make_context()
        try:
            kvstore = ts.KvStore.open(kvstore_spec(directory), context=context).result()
        except Exception:
            return None
        opened = cls(directory, context, kvstore, kvstore.read(""))
        try:
            metadata_bytes = os.stat(os.path.join(os.fspath(directory), METADATA_FILE)).st_size
        except OSError:
            metadata_bytes = 0
        if metadata_bytes > PREFETCH_METADATA_BYTES:
            opened.index.prefetch()
        return opened


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


async def _settle(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Lets the other tasks finish after one failed.

    Cancelling a task that awaits a TensorStore future leaves the future's
    callback pointing at this event loop, which may be closed by the time
    the I/O ends; waiting for them is safe, and bounded by their I/O.
    """
    await asyncio.gather(*tasks, return_exceptions=True)


# -- Writing -----------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class ArrayWrite:
    """One array to write: its layout and the chunks this process owns.

    ``chunks`` maps a chunk index to that chunk's data (edge chunks may be
    smaller than ``layout.chunk_shape``). Neither changes once the write is
    built: what depends on them is computed then, once (a save asks for it
    several times for each of thousands of arrays).
    """

    what: Any  # Names the leaf in errors (its str(), formatted only when needed).
    layout: _zarr3.ZarrLayout
    chunks: list[tuple[tuple[int, ...], np.ndarray]]
    inner_chunk_shape: tuple[int, ...] | None = None
    compression: bool = False
    write_metadata: bool = True
    # The array's extra value metadata: the writer adds each chunk's checksum to it.
    record: dict[str, Any] | None = None
    # Bytes of data this process writes for the array.
    nbytes: int = dataclasses.field(init=False, repr=False, compare=False)
    # Uncompressed, one inner chunk per shard: readable without the zarr3 driver.
    one_chunk_shards: bool = dataclasses.field(init=False, repr=False, compare=False)
    # Small and plain enough to be encoded here, without the zarr3 driver.
    direct: bool = dataclasses.field(init=False, repr=False, compare=False)
    _owns_all: bool | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        chunks, layout = self.chunks, self.layout
        self.nbytes = (
            int(chunks[0][1].nbytes)
            if len(chunks) == 1
            else sum(int(data.nbytes) for _, data in chunks)
        )
        self.one_chunk_shards = not self.compression and self.inner_chunk_shape in (
            None,
            layout.chunk_shape,
        )
        self.direct = bool(
            self.one_chunk_shards
            and _zarr3.is_direct_dtype(layout.dtype)
            and self.nbytes <= DIRECT_WRITE_BYTES
            and layout.chunk_nbytes <= DIRECT_WRITE_BYTES
        )

    @property
    def records_checksums(self) -> bool:
        """Whether loads can check this large array against checksums recorded in _METADATA."""
        return self.record is not None and self.one_chunk_shards and self.owns_all_chunks

    @property
    def owns_all_chunks(self) -> bool:
        """Whether this process writes every chunk (not so in multi-process saves)."""
        if self._owns_all is None:  # Only asked for arrays with a record: computed then.
            layout = self.layout
            self._owns_all = len(self.chunks) == len(
                _zarr3.all_chunk_indices(layout.shape, layout.chunk_shape)
            )
        return self._owns_all

    def metadata(self) -> dict[str, Any]:
        """The zarr3 metadata of the array."""
        layout = self.layout
        return _zarr3.metadata_dict(
            layout.shape,
            layout.dtype,
            layout.chunk_shape,
            self.inner_chunk_shape,
            compression=self.compression,
        )

    def zarr_json(self) -> bytes:
        """The bytes of the array's ``zarr.json``."""
        layout = self.layout
        if self.one_chunk_shards:
            return _zarr3.zarr_json(layout.shape, layout.dtype, layout.chunk_shape)
        import json

        return json.dumps(self.metadata(), separators=(",", ":"), sort_keys=True).encode()


def _full_chunk(data: np.ndarray, layout: _zarr3.ZarrLayout) -> np.ndarray:
    """``data`` as a C-contiguous full chunk (edge chunks are padded with zeros)."""
    if data.shape != layout.chunk_shape:
        full = np.zeros(layout.chunk_shape, dtype=layout.dtype)
        full[tuple(slice(0, s) for s in data.shape)] = data
        return full
    return np.ascontiguousarray(data, dtype=layout.dtype)


def _record_checksums(items: Sequence[ArrayWrite]) -> None:
    # NumPy's sums and zlib release the GIL: this runs beside TensorStore's writes.
    kind = _checksums.SUMS_CRC32
    for item in items:
        assert item.record is not None
        item.record[kind] = [
            _checksums.checksum(kind, _full_chunk(data, item.layout).reshape(-1).view(np.uint8))
            for _, data in item.chunks
        ]


def _fsync_new_files(directory: epath.Path, done: set[str]) -> None:
    """Flushes the database's data files not flushed yet (they are immutable once written)."""
    if not cp.storage.is_local(directory):
        return  # An object store's writes are durable once acknowledged.
    data = os.path.join(os.fspath(directory), "d")
    try:
        names = os.listdir(data)
    except FileNotFoundError:
        return
    for name in names:
        if name in done:
            continue
        try:
            fd = os.open(os.path.join(data, name), os.O_RDONLY)
        except FileNotFoundError:
            continue  # A temporary file TensorStore renamed meanwhile; the commit flushes the rest.
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        done.add(name)


class ArrayWriter:
    """Collects the arrays of one save, then writes them all (``run``)."""

    def __init__(self, directory: cp.path.PathAwaitingCreation) -> None:
        self._directory = directory
        self._items: list[ArrayWrite] = []
        # Done once `run` recorded every checksum (also after a failure: waiters then
        # see run's error rather than hang).
        self._recorded: asyncio.Future[None] | None = None
        self._flushed: set[str] = set()
        self._specs: dict[tuple[Any, ...], ts.Spec] = {}
        # From prepare_early: (arrays then, their small-array batches, the first one's work).
        self._early: tuple[int, list[list[ArrayWrite]], concurrent.futures.Future[Any]] | None = (
            None
        )

    def prepare_early(self) -> None:
        """Starts checksumming the first batch of small arrays, in a worker thread.

        Called once every array is added (at the end of a save's blocking phase):
        the checksums, the slowest part of writing many small arrays, then run
        while the rest of the save is set up. Does nothing for a few small arrays.
        """
        if self._early is not None:
            return
        small = [i for i in self._items if i.direct]
        batches = _batches(small, _batch_budget(sum(i.nbytes for i in small)))
        if batches and sum(i.nbytes for i in batches[0]) > INLINE_CHECKSUM_BYTES:
            work = _prepare_pool().submit(_prepare_small, batches[0])
            self._early = (len(self._items), batches, work)

    async def checksums(self) -> None:
        """Waits until every recorded checksum is in its array's ``record`` (``run`` must run)."""
        await self._recorded_future()

    def _recorded_future(self) -> asyncio.Future[None]:
        if self._recorded is None:
            self._recorded = asyncio.get_running_loop().create_future()
        return self._recorded

    def _all_recorded(self, writes: asyncio.Future[Any] | None = None) -> None:
        if writes is not None and not writes.cancelled():
            writes.exception()  # Retrieved here; run raises it.
        recorded = self._recorded_future()
        if not recorded.done():
            recorded.set_result(None)

    def add(self, item: ArrayWrite) -> None:
        """Schedules ``item``; nothing is written before ``run``."""
        self._items.append(item)

    @property
    def empty(self) -> bool:
        """Whether no array was added."""
        return not self._items

    async def run(self) -> None:
        """Writes every array added; returns once all are committed to the database.

        Raises:
          cp.errors.StorageError: an object store failed requests beyond TensorStore's retries.
        """
        try:
            with _errors.object_store_failures(self._directory.path, "Writing the arrays to"):
                await self._run()
        finally:
            self._all_recorded()

    async def _run(self) -> None:
        if not self._items:
            return
        root = await self._directory.await_creation()
        database = database_directory(root)
        context = make_context(SAVE_OCDBT_CACHE_BYTES)
        kvstore = await ts.KvStore.open(kvstore_spec(database, create=True), context=context)
        large = [i for i in self._items if not i.direct]
        small = [i for i in self._items if i.direct]
        early = self._early
        if early is not None and early[0] != len(self._items):
            early = None  # Arrays were added since: its result is not used.
        limiter = ByteLimiter(IN_FLIGHT_BYTES)
        # Large arrays are encoded by TensorStore's threads while this thread
        # encodes the small ones.
        groups = _batches(large, LARGE_GROUP_BYTES)
        writers = _writer_databases(database, len(groups))
        stores = {database: kvstore}
        for writer in writers:
            if writer != database:
                stores[writer] = await ts.KvStore.open(
                    kvstore_spec(writer, create=True), context=context
                )
        loop = asyncio.get_running_loop()
        committed: list[asyncio.Future[None]] = [loop.create_future() for _ in groups]
        checksummed: list[asyncio.Future[None]] = [loop.create_future() for _ in groups]
        large_tasks = [
            asyncio.ensure_future(
                self._write_large(
                    group,
                    writers[n % len(writers)],
                    stores,
                    context,
                    limiter,
                    committed[n],
                    checksummed[n],
                )
            )
            for n, group in enumerate(groups)
        ]
        if writers != [database]:
            # Merged as soon as every group is committed, while the last ones are flushed.
            large_tasks.append(asyncio.ensure_future(_merge_when(committed, database, writers)))
        # Let the large groups start (TensorStore opens their arrays) before this thread
        # checksums the small arrays.
        await asyncio.sleep(0)
        commits: list[asyncio.Future[Any]] = []
        prepared: collections.deque[asyncio.Future[_Prepared]] = collections.deque()
        small_recorded = asyncio.get_running_loop().create_future()
        # _METADATA can be written once every checksum is known, while the last groups
        # are still being flushed.
        asyncio.gather(small_recorded, *checksummed).add_done_callback(self._all_recorded)
        try:
            metadata_only = [i for i in large if i.write_metadata]
            batches = (
                early[1] if early else _batches(small, _batch_budget(sum(i.nbytes for i in small)))
            ) or [[]]
            # Worker threads checksum the next batches (mostly in TensorStore, without
            # the GIL) while this thread encodes the current one.
            remaining = len(batches)

            def prepare(
                batch: list[ArrayWrite], started: asyncio.Future[_Prepared] | None = None
            ) -> asyncio.Future[_Prepared]:
                def one_less(_: Any) -> None:
                    nonlocal remaining
                    remaining -= 1
                    if not remaining and not small_recorded.done():
                        # Every CRC-32 is recorded: _METADATA is written during the commits.
                        small_recorded.set_result(None)

                future = started if started is not None else _prepare_soon(batch)
                future.add_done_callback(one_less)
                return future

            prepared.append(prepare(batches[0], asyncio.wrap_future(early[2]) if early else None))
            prepared.extend(prepare(b) for b in batches[1:PREPARED_AHEAD])
            for n, batch in enumerate(batches):
                ready = await prepared.popleft()
                if n + PREPARED_AHEAD < len(batches):
                    prepared.append(prepare(batches[n + PREPARED_AHEAD]))
                with execution.paused_gc():
                    transaction = self._stage_small(kvstore, batch, ready, metadata_only)
                metadata_only = []
                del ready
                # TensorStore commits one batch while this thread encodes the next; at
                # most two are held in memory.
                commits.append(asyncio.ensure_future(_await(transaction.commit_async())))
                if len(commits) == 2:
                    await commits.pop(0)
            await asyncio.gather(*commits, *large_tasks)
        except BaseException:
            await _settle([*commits, *large_tasks, *prepared])
            raise

    def _stage_small(
        self,
        kvstore: ts.KvStore,
        items: Sequence[ArrayWrite],
        prepared: _Prepared,
        metadata_only: Sequence[ArrayWrite],
    ) -> ts.Transaction:
        keys, chunks, checksums = prepared
        transaction = ts.Transaction()
        write = kvstore.with_transaction(transaction).write
        for item in (*items, *metadata_only):
            if item.write_metadata:
                write(item.layout.name + "/zarr.json", item.zarr_json())
        encode = _zarr3.encode_shard
        for key, chunk, checksum in zip(keys, chunks, checksums, strict=True):
            write(key, encode(memoryview(chunk), checksum))
        return transaction

    def _zarr3_spec(self, item: ArrayWrite) -> ts.Spec:
        """The zarr3 spec of ``item`` (without its kvstore), parsed once per distinct layout."""
        layout = item.layout
        key = (layout.shape, layout.dtype, layout.chunk_shape, item.inner_chunk_shape)
        key += (item.compression,)
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = ts.Spec(
                {
                    "driver": "zarr3",
                    "metadata": item.metadata(),
                    "store_data_equal_to_fill_value": True,
                }
            )
        return spec

    async def _write_large(
        self,
        items: Sequence[ArrayWrite],
        database: epath.Path,
        kvstores: dict[epath.Path, ts.KvStore],
        context: ts.Context,
        limiter: ByteLimiter,
        committed: asyncio.Future[None],
        checksummed: asyncio.Future[None],
    ) -> None:
        """Writes a group of arrays through the zarr3 driver, as one OCDBT commit.

        ``committed`` is done once the commit is (or failed); then the group's data
        files are flushed and its checksums recorded (``checksummed`` is done then,
        or cancelled if the group failed).
        """
        try:
            await self._commit_large(items, kvstores[database], context, limiter)
        except BaseException:
            committed.cancel()  # Nothing to merge: this task reports the failure.
            checksummed.cancel()
            raise
        committed.set_result(None)
        # The disk flushes this group while later ones are encoded, rather than all at
        # the checkpoint's commit; its checksums, wanted only for _METADATA, are
        # computed meanwhile, when the CPU would otherwise wait for the disk.
        recorded = [i for i in items if i.records_checksums]
        flush = asyncio.ensure_future(asyncio.to_thread(_fsync_new_files, database, self._flushed))
        try:
            if recorded:
                await asyncio.to_thread(_record_checksums, recorded)
        except BaseException:
            checksummed.cancel()
            await _settle([flush])
            raise
        checksummed.set_result(None)
        await flush

    async def _commit_large(
        self,
        items: Sequence[ArrayWrite],
        base: ts.KvStore,
        context: ts.Context,
        limiter: ByteLimiter,
    ) -> None:
        """Opens, writes and commits one group of arrays in the database ``base`` opens."""
        # A group of several arrays is one transaction: one commit instead of one each.
        transaction = ts.Transaction() if len(items) > 1 else None
        # Opened all at once, before waiting for the byte limit (an open holds no data),
        # from parsed specs and an open kvstore: a JSON spec costs twice as much.
        stores = await _ts_futures.wait_all(
            [
                ts.open(
                    self._zarr3_spec(item),
                    kvstore=base / (item.layout.name + "/"),
                    # zarr.json is written with the small arrays' batch.
                    assume_metadata=True,
                    context=context,
                    transaction=transaction,
                )
                for item in items
            ]
        )
        async with limiter.hold(sum(i.nbytes for i in items)):
            futures = [
                # An array of one chunk is written whole: indexing costs as much as the write.
                (
                    store if data.shape == item.layout.shape else store[item.layout.region(index)]
                ).write(data, can_reference_source_data_indefinitely=True)
                for item, store in zip(items, stores, strict=True)
                for index, data in item.chunks
            ]
            if transaction is None:
                await _ts_futures.wait_all(futures)
            else:
                await _ts_futures.wait_all([f.copy for f in futures])
                await transaction.commit_async()


def _writer_databases(database: epath.Path, groups: int) -> list[epath.Path]:
    """The databases that ``groups`` groups of large arrays are committed to."""
    writers = WRITERS if _value_files.is_local(database) else REMOTE_WRITERS
    if groups < 2 or writers < 2:
        return [database]
    return [database / f"{WRITER_PREFIX}{i}" for i in range(min(writers, groups))]


async def _merge_when(
    committed: Sequence[asyncio.Future[None]], database: epath.Path, writers: Sequence[epath.Path]
) -> None:
    """Merges the writers' databases into ``database`` once every group is committed."""
    await asyncio.gather(*committed, return_exceptions=True)
    if any(c.cancelled() for c in committed):
        return  # A group failed: its own task reports it.
    await asyncio.to_thread(_merge_writers, database, writers)


def _merge_writers(database: epath.Path, writers: Sequence[epath.Path]) -> None:
    """Makes ``database`` hold the writers' keys (their data files stay where they are)."""
    # Imported here: _ocdbt_merge builds on this module.
    from checkpointables_pytree import _ocdbt_merge

    _ocdbt_merge.merge_into(database, [_ocdbt_merge.Source(w) for w in writers])


async def _await(awaitable: Any) -> Any:
    return await awaitable


# A batch of small arrays ready to encode: chunk keys, chunk bytes, their CRC-32Cs.
_Prepared = tuple[list[str], list[np.ndarray], list[int]]


def _prepare_small(items: Sequence[ArrayWrite]) -> _Prepared:
    """The keys, bytes and CRC-32Cs of the small arrays' chunks; records their zlib CRC-32s.

    (For small chunks zlib's CRC-32 costs less than a NumPy call: see ``_checksums``.)
    """
    keys: list[str] = []
    chunks: list[np.ndarray] = []
    crc32, chunk_key, kind = zlib.crc32, _zarr3.chunk_key, _checksums.CRC32
    # Plain loops and map(): a comprehension costs a frame per array (most have one chunk).
    for item in items:
        layout = item.layout
        name = layout.name
        mine = []
        for index, data in item.chunks:
            keys.append(chunk_key(name, index))
            mine.append(_full_chunk(data, layout).reshape(-1).view(np.uint8))
        chunks += mine
        if item.record is not None and item.owns_all_chunks:
            item.record[kind] = list(map(crc32, mine))
    return keys, chunks, _crc32c.crc32c_of_bytes(chunks).tolist()


@functools.cache
def _prepare_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that checksum small arrays ahead of a save's background phase."""
    return concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="checkpointables-crc")


def _prepare_soon(items: Sequence[ArrayWrite]) -> asyncio.Future[_Prepared]:
    """``_prepare_small(items)``: in a worker thread, or here for a few small arrays."""
    loop = asyncio.get_running_loop()
    if sum(i.nbytes for i in items) > INLINE_CHECKSUM_BYTES:
        # Submitted now (asyncio.to_thread would wait for this thread's next await).
        return loop.run_in_executor(None, _prepare_small, items)
    done: asyncio.Future[_Prepared] = loop.create_future()
    try:
        done.set_result(_prepare_small(items))
    except Exception as e:
        done.set_exception(e)
    return done


def _batch_budget(total: int) -> int:
    """Bytes per batch of small arrays: at most ``SMALL_BATCH_BYTES``, and at least two
    batches once there is enough data for checksumming, encoding and committing to overlap."""
    if total <= 4 * SMALL_ARRAY_BYTES:
        return SMALL_BATCH_BYTES
    return min(SMALL_BATCH_BYTES, -(-total // 2))


def _batches(items: Sequence[ArrayWrite], budget: int) -> list[list[ArrayWrite]]:
    batches: list[list[ArrayWrite]] = [[]]
    used = 0
    for item in items:
        if batches[-1] and used + item.nbytes > budget:
            batches.append([])
            used = 0
        batches[-1].append(item)
        used += item.nbytes
    return [b for b in batches if b]


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


# -- Reading -----------------------------------------------------------------------


class ArrayReader:
    """Collects the arrays of one load, then reads them all (``run``)."""

    def __init__(
        self,
        directory: epath.Path,
        *,
        ocdbt: bool = True,
        zarr3: bool = True,
        verify: bool = True,
        opened: OpenedDatabase | None = None,
        cross_check: bool = False,
    ) -> None:
        self._directory = directory
        self._opened = opened if ocdbt else None
        self._cross_check = cross_check
        self._ocdbt = ocdbt
        self._zarr3 = zarr3
        # False skips the checksums computed here (the zarr3 driver always checks its own).
        self._verify = verify
        self._reads: list[ArrayRead] = []
        self._index: _value_files.DatabaseIndex | None = None
        if self._opened is not None:
            self._index = self._opened.index
        elif ocdbt and _value_files.is_local(directory):
            self._index = _value_files.DatabaseIndex(directory)
        elif ocdbt:  # An object store: small values are read in few requests.
            self._index = _value_files.DatabaseIndex(directory, _base(directory))

    def array_spec(self, name: str) -> dict[str, Any]:
        if self._ocdbt:
            kvstore: Any = kvstore_spec(self._directory, path=name + "/")
        else:  # Orbax's use_ocdbt=False layout: one directory per array.
            kvstore = _base(self._directory / name)
            if kvstore["driver"] == "file":  # Object-store specs' paths end with "/" already.
                kvstore["path"] += "/"
        return {"driver": "zarr3" if self._zarr3 else "zarr", "kvstore": kvstore}

    def add(self, read: ArrayRead) -> None:
        """Schedules ``read``; ``read.result`` is set by ``run``.

        Raises:
          cp.errors.TreeMismatchError: the recorded shape differs from the target's.
        """
        stored, target = read.stored, read.target_shape
        if stored is not None and target is not None and tuple(target) != stored.shape:
            check_shape(read, stored.shape)  # Fail before any read, when possible.
        self._reads.append(read)

    async def run(self) -> None:
        """Reads every scheduled array and converts it."""
        if not self._reads:
            return
        opened = self._opened
        context = opened.context if opened is not None else make_context()
        direct: list[ArrayRead] = []
        raw: list[ArrayRead] = []
        others: list[ArrayRead] = []
        for read in self._reads:
            (direct if read.direct else raw if read.raw else others).append(read)
        limiter = ByteLimiter(IN_FLIGHT_BYTES)
        kvstore = None
        if opened is not None:
            kvstore = opened.kvstore
        elif direct or raw:
            try:
                kvstore = await ts.KvStore.open(kvstore_spec(self._directory), context=context)
            except Exception as e:
                raise _errors.storage_error(f"the arrays of {self._directory}", e) from e
        if self._cross_check:
            await self._check_zarr_json(kvstore, [*direct, *raw])
        locations = await self._locate(raw)
        tasks = [asyncio.ensure_future(self._read_with_driver(r, context, limiter)) for r in others]
        if raw:
            # Each holds only its group's arrays: no byte limit.
            tasks.append(
                asyncio.ensure_future(
                    _large_reads.read_large(
                        kvstore,
                        raw,
                        verify=self._verify,
                        locations=locations,
                        remote=not _value_files.is_local(self._directory),
                    )
                )
            )
        try:
            if direct:
                for batch in _read_batches(direct, SMALL_BATCH_BYTES):
                    await self._read_direct(kvstore, batch)
            if tasks:
                await asyncio.gather(*tasks)
        except BaseException:
            await _settle(tasks)
            raise

    async def _check_zarr_json(self, kvstore: Any, reads: Sequence[ArrayRead]) -> None:
        """Each array's ``zarr.json`` must be the one written for its recorded layout."""
        if not reads:
            return
        try:
            values = await read_values(kvstore, [f"{r.name}/zarr.json" for r in reads])
        except Exception as e:
            raise _errors.storage_error(f"the arrays of {self._directory}", e) from e
        for read, value in zip(reads, values, strict=True):
            stored = read.stored
            assert stored is not None
            if value != _zarr3.zarr_json(stored.shape, stored.dtype, stored.chunk_shape):
                raise _errors.integrity_error(
                    f"{read.what} (array {read.name!r})",
                    "its zarr.json does not describe the shape and dtype _METADATA records",
                )

    async def _read_direct(self, kvstore: ts.KvStore, reads: Sequence[ArrayRead]) -> None:
        keys: list[str] = []
        for read in reads:
            stored = read.stored
            assert stored is not None
            if stored.chunk_shape == stored.shape:  # One chunk: skip listing the chunk grid.
                keys.append(_zarr3.chunk_key(read.name, (0,) * len(stored.shape)))
            else:
                keys.extend(_zarr3.chunk_key(read.name, i) for i in stored.chunk_indices)
        found: list[Any] = [None] * len(keys)
        local = _value_files.is_local(self._directory)
        if self._index is not None and (len(keys) > INLINE_READ_KEYS or not local):
            # A damaged database: TensorStore's reads below report it, naming it.
            with contextlib.suppress(Exception):
                if local:
                    found = await _local_values.read_local_values(self._index, keys)
                else:
                    found = await _remote_values.read_remote_values(self._index, keys)
        rest = [i for i, value in enumerate(found) if value is None]
        try:
            if rest:
                values = await read_values(kvstore, [keys[i] for i in rest])
                for i, value in zip(rest, values, strict=True):
                    found[i] = value
        except Exception as e:  # An OCDBT node that fails to decode.
            raise _errors.storage_error(f"the arrays of {self._directory}", e) from e
        with execution.paused_gc():
            self._decode(reads, found)

    def _decode(self, reads: Sequence[ArrayRead], values: list[Any]) -> None:
        # Decode every shard; check recorded checksums at once, the others in one CRC-32C batch.
        position = 0
        decoded: list[list[memoryview] | None] = []
        unchecked: list[tuple[ArrayRead, memoryview, int]] = []
        done: list[tuple[ArrayRead, list[np.ndarray]]] = []  # Converted in one batch at the end.
        verify = self._verify
        crc32 = zlib.crc32
        frombuffer = np.frombuffer
        trailer_of = _zarr3.shard_trailer
        for read in reads:
            stored = read.stored
            assert stored is not None
            shape = stored.shape
            sums = stored.checksums
            if (
                stored.single_chunk
                and sums is not None
                and len(sums) == 1
                and stored.checksum_kind == _checksums.CRC32
                and read.regions is None
                and (read.target_shape is None or read.target_shape == shape)
            ):
                # The usual small array: one chunk with a recorded CRC-32, wanted whole.
                nbytes = stored.nbytes
                value = values[position]
                if len(value) == nbytes + 24 and value[nbytes + 4 :] == trailer_of(nbytes):
                    data = memoryview(value)[:nbytes]
                    if verify and crc32(data) != sums[0]:
                        raise _errors.integrity_error(
                            read.what, "a chunk's checksum does not match its data"
                        )
                    position += 1
                    decoded.append(None)
                    done.append((read, [frombuffer(data, dtype=stored.dtype).reshape(shape)]))
                    continue
            indices = stored.chunk_indices
            nbytes = math.prod(stored.chunk_shape) * stored.dtype.itemsize
            trailer = _zarr3.shard_trailer(nbytes)
            views = []
            for n, index in enumerate(indices):
                value = values[position + n]
                if len(value) != nbytes + 24 or value[nbytes + 4 :] != trailer:
                    problem = (
                        "is missing" if not value else "does not have the layout that was written"
                    )
                    raise _errors.integrity_error(
                        read.what, f"chunk {_zarr3.chunk_key(read.name, index)} {problem}"
                    )
                data = memoryview(value)[:nbytes]
                if self._verify and stored.checksums is not None:
                    if _checksums.checksum(stored.checksum_kind, data) != stored.checksums[n]:
                        raise _errors.integrity_error(
                            read.what, "a chunk's checksum does not match its data"
                        )
                elif self._verify:
                    unchecked.append(
                        (read, data, int.from_bytes(value[nbytes : nbytes + 4], "little"))
                    )
                views.append(data)
            position += len(indices)
            decoded.append(views)
        if unchecked:
            computed = _crc32c.crc32c_many([data for _, data, _ in unchecked])
            stored_sums = np.fromiter((c for _, _, c in unchecked), np.uint32, len(unchecked))
            bad = np.flatnonzero(computed != stored_sums)
            if bad.size:
                names = sorted({unchecked[i][0].what for i in bad.tolist()})
                raise _errors.integrity_error(
                    ", ".join(names), "a chunk's CRC-32C checksum does not match its data"
                )
        for read, views in zip(reads, decoded, strict=True):
            if views is None:
                continue  # Converted above.
            stored = read.stored
            assert stored is not None
            done.append((read, pieces_of(read, _assemble(read.name, stored, views))))
        convert_all(done)

    async def _locate(self, reads: Sequence[ArrayRead]) -> dict[str, _value_files.ValueLocation]:
        """Where the shards of ``reads`` are, when the database is local (else empty)."""
        if not reads or self._index is None or not _value_files.is_local(self._directory):
            return {}  # (Large values on object stores are read in ranges by _large_reads.)
        keys = [
            _zarr3.chunk_key(r.name, i)
            for r in reads
            for i in r.stored.chunk_indices  # type: ignore[union-attr]
        ]
        try:
            return await _value_files.locate(self._index, keys)
        except Exception:  # A damaged database: TensorStore's reads report it, naming the leaf.
            return {}

    async def _read_with_driver(
        self, read: ArrayRead, context: ts.Context, limiter: ByteLimiter
    ) -> None:
        spec = self.array_spec(read.name)
        spec["fill_missing_data_reads"] = False  # A missing chunk is damage, not zeros.
        try:
            store = await ts.open(spec, context=context, open=True)
        except Exception as e:
            raise _errors.storage_error(f"{read.what} (array {read.name!r})", e) from e
        stored_shape = tuple(int(s) for s in store.shape)
        _check_against_metadata(read, stored_shape, store.dtype.numpy_dtype)
        target = check_shape(read, stored_shape)
        regions = regions_of(read, target)
        nbytes = sum(math.prod(region_shape(r)) for r in regions) * store.dtype.numpy_dtype.itemsize
        _check_fits_in_memory(read, nbytes)
        # The regions of one process's devices usually tile one block: read it once
        # rather than every chunk once per region that touches it.
        box = _tiling_box(regions)
        async with limiter.hold(nbytes):
            pieces = []
            for region in regions if box is None else [box]:
                parts = intersect(region, stored_shape) if region else ((), ())
                if parts is None:
                    pieces.append(np.zeros(region_shape(region), dtype=store.dtype.numpy_dtype))
                    continue
                source, destination = parts
                try:
                    data = await store[source].read() if source else await store.read()
                except Exception as e:
                    raise _errors.storage_error(f"{read.what} (array {read.name!r})", e) from e
                if data.shape != region_shape(region):
                    padded = np.zeros(region_shape(region), dtype=data.dtype)
                    padded[destination] = data
                    data = padded
                pieces.append(data)
            if box is not None:
                block = pieces[0]
                pieces = [
                    block[
                        tuple(
                            slice(r.start - b.start, r.stop - b.start)
                            for r, b in zip(region, box, strict=True)
                        )
                    ]
                    for region in regions
                ]
            read.result = read.convert(pieces)


def _check_against_metadata(read: ArrayRead, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """The array's own ``zarr.json`` must agree with what ``_METADATA`` recorded of it."""
    stored = read.stored
    if stored is not None and (shape != stored.shape or dtype != stored.dtype):
        raise _errors.integrity_error(
            f"{read.what} (array {read.name!r})",
            f"its zarr.json records shape {shape} and dtype {dtype}, but _METADATA records "
            f"shape {stored.shape} and dtype {stored.dtype}",
        )


@functools.cache
def physical_memory_bytes() -> int:
    """The machine's memory (``0`` where unknown)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (OSError, ValueError, AttributeError):
        return 0


def _check_fits_in_memory(read: ArrayRead, nbytes: int) -> None:
    """Refuses, before anything is allocated, a read larger than the machine's memory."""
    memory = physical_memory_bytes()
    if memory and nbytes > memory:
        raise cp.errors.MetadataError(
            f"{read.what} (array {read.name!r}): loading it here needs {nbytes:,} bytes, more "
            f"than this machine's memory ({memory:,} bytes). If the checkpoint is damaged, restore "
            f"it from a copy; otherwise load it across more processes, or skip the leaf "
            f"(cp.PLACEHOLDER in the abstract tree)."
        )


def _tiling_box(regions: Sequence[Region]) -> Region | None:
    """The block several regions tile exactly, or ``None`` (one region, or gaps between them)."""
    if len(regions) < 2 or not regions[0]:
        return None
    box = tuple(
        slice(min(r[d].start for r in regions), max(r[d].stop for r in regions))
        for d in range(len(regions[0]))
    )
    # Distinct regions of a sharding never overlap: equal volumes mean no gaps.
    if sum(math.prod(region_shape(r)) for r in regions) != math.prod(region_shape(box)):
        return None
    return box


def _assemble(name: str, stored: StoredArray, views: list[memoryview]) -> np.ndarray:
    """The whole array from its decoded chunks (a fresh, writable array)."""
    if len(views) == 1 and stored.chunk_shape == stored.shape:
        # A read-only view of the value: conversions copy (device_put) or make it writable.
        return np.frombuffer(views[0], dtype=stored.dtype).reshape(stored.shape)
    layout = _zarr3.ZarrLayout(name, stored.shape, stored.dtype, stored.chunk_shape)
    full = np.empty(layout.shape, dtype=layout.dtype)
    for index, view in zip(stored.chunk_indices, views, strict=True):
        chunk = np.frombuffer(view, dtype=layout.dtype).reshape(layout.chunk_shape)
        region = layout.region(index)
        full[region] = chunk[tuple(slice(0, r.stop - r.start) for r in region)]
    return full


def _read_batches(reads: Sequence[ArrayRead], budget: int) -> list[list[ArrayRead]]:
    batches: list[list[ArrayRead]] = [[]]
    used = 0
    for read in reads:
        assert read.stored is not None
        size = read.stored.nbytes
        if batches[-1] and used + size > budget:
            batches.append([])
            used = 0
        batches[-1].append(read)
        used += size
    return [b for b in batches if b]
