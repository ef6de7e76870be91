"""The writer: every array of one save, written in one ``Writer.run``.

Leaf handlers ``add`` an ``ArrayWrite`` per leaf (its layout, and the host
data of the chunks this process owns); ``run`` then writes them all into the
pytree's OCDBT database:

* small arrays (up to ``DIRECT_WRITE_BYTES``, uncompressed, one inner chunk
  per shard) are encoded here into the exact keys TensorStore's zarr3 driver
  would write (``<name>/zarr.json`` and one shard per chunk: the data, its
  CRC-32C, the shard index, see ``_zarr3``) and written through one kvstore
  in transactions of about ``SMALL_BATCH_BYTES``; one commits while the
  next is encoded, and is flushed once committed. Opening a zarr3 driver
  costs about 150 us of Python per array, and its CRC-32C is TensorStore's
  portable code;
* larger arrays, and any compressed or finely chunked one, go through the
  zarr3 driver, in groups of about ``LARGE_GROUP_BYTES`` committed by
  several OCDBT writers (databases of their own, merged into the pytree's
  at the end); each group's data files are flushed while later groups are
  encoded.

Everything of one save shares one ``ts.Context``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import checkpointables as cp
import crc32c
import numpy as np
import tensorstore as ts
from checkpointables import execution
from etils import epath

from checkpointables_pytree import _errors, _ocdbt, _ts_futures, _zarr3
from checkpointables_pytree._ts_futures import ByteLimiter, settle

__all__ = ["ArrayWrite", "Writer", "DIRECT_WRITE_BYTES", "LARGE_GROUP_BYTES", "WRITER_PREFIX"]

# Arrays up to this size are encoded here (two copies, hardware CRC-32C), larger ones by the
# zarr3 driver (no copy, portable CRC-32C at ~4 GB/s, ~50 us per array). CPU for 128 MiB of
# arrays of 128 KiB: 122 here against 177 ms; of 512 KiB: 95 against 108 ms; of 2 MiB: even.
DIRECT_WRITE_BYTES = 1 << 20
# Small arrays per transaction: bounds the memory a batch of encoded keys takes.
SMALL_BATCH_BYTES = 32 << 20
# Large arrays being encoded at once: bounds the extra memory of a save.
IN_FLIGHT_BYTES = 128 << 20
# Arrays written through the driver are grouped into transactions of at most this
# many bytes (one commit each); a larger array is written alone.
LARGE_GROUP_BYTES = 32 << 20
# Groups are committed by this many OCDBT writers. One writer commits one transaction at
# a time and writes its data file on one thread: with one writer a 256 MiB save waited
# for those writes, and the disk sat idle until the first commit ended.
WRITERS = 4
# On an object store each commit waits for several requests (tens of ms each) besides its
# data PUT: more writers keep more PUTs in flight (see docs/performance.md, "Object stores").
REMOTE_WRITERS = 16
WRITER_PREFIX = "ocdbt.writer_"


@dataclasses.dataclass(slots=True)
class ArrayWrite:
    """One array to write: its layout and the chunks this process owns.

    ``chunks`` maps a chunk index to that chunk's data (edge chunks may be
    smaller than ``layout.chunk_shape``). Neither changes once the write is
    built: what depends on them is computed then, once.
    """

    what: Any  # Names the leaf in errors (its str(), formatted only when needed).
    layout: _zarr3.ZarrLayout
    chunks: list[tuple[tuple[int, ...], np.ndarray]]
    inner_chunk_shape: tuple[int, ...] | None = None
    compression: bool = False
    write_metadata: bool = True
    # Bytes of data this process writes for the array.
    nbytes: int = dataclasses.field(init=False, repr=False, compare=False)
    # Uncompressed, one inner chunk per shard: readable without the zarr3 driver.
    one_chunk_shards: bool = dataclasses.field(init=False, repr=False, compare=False)
    # Small and plain enough to be encoded here, without the zarr3 driver.
    direct: bool = dataclasses.field(init=False, repr=False, compare=False)

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
            and layout.direct_dtype
            and self.nbytes <= DIRECT_WRITE_BYTES
            and layout.chunk_nbytes <= DIRECT_WRITE_BYTES
        )

    def zarr_json(self) -> bytes:
        """The bytes of the array's ``zarr.json``."""
        layout = self.layout
        if self.one_chunk_shards:
            return _zarr3.zarr_json(layout.shape, layout.dtype, layout.chunk_shape)
        return json.dumps(self.metadata(), separators=(",", ":"), sort_keys=True).encode()

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


class Writer:
    """Collects the arrays of one save, then writes them all (``run``)."""

    def __init__(self, directory: cp.path.PathAwaitingCreation) -> None:
        self._directory = directory
        self._items: list[ArrayWrite] = []
        self._flushed: set[str] = set()
        self._specs: dict[tuple[Any, ...], ts.Spec] = {}

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
        if not self._items:
            return
        with _errors.object_store_failures(self._directory.path, "Writing the arrays to"):
            root = await self._directory.await_creation()
            database = _ocdbt.database_directory(root)
            context = _ocdbt.make_context(_ocdbt.SAVE_OCDBT_CACHE_BYTES)
            kvstore = await _ocdbt.open_kvstore(database, context, create=True)
            large = [i for i in self._items if not i.direct]
            # TensorStore's threads encode the large arrays while this thread encodes the small.
            tasks = await self._start_large(large, database, kvstore, context)
            try:
                small = [i for i in self._items if i.direct]
                await self._write_small(kvstore, database, small, large)
                await asyncio.gather(*tasks)
            except BaseException:
                await settle(tasks)
                raise

    async def _write_small(
        self,
        kvstore: ts.KvStore,
        database: epath.Path,
        small: Sequence[ArrayWrite],
        large: Sequence[ArrayWrite],
    ) -> None:
        """Encodes the small arrays batch by batch; one commits while the next is encoded.

        The first batch also carries every large array's ``zarr.json``.
        """
        metadata_only = [i for i in large if i.write_metadata]
        commits: list[asyncio.Future[Any]] = []
        flushes: list[asyncio.Future[Any]] = []
        try:
            batches = _batches(small, SMALL_BATCH_BYTES) or [[]]
            for n, batch in enumerate(batches, 1):
                with execution.paused_gc():
                    transaction = _stage_small(kvstore, batch, metadata_only)
                metadata_only = []
                # The last batch is flushed by the checkpoint's commit with its other files
                # (an fsync of its own costs a journal commit: ~4 ms for a tiny save).
                flush_to = database if n < len(batches) else None
                # Started here: a task would only start once this loop awaits.
                committed = self._flush_when(transaction.commit_async(), flush_to, flushes)
                commits.append(asyncio.ensure_future(committed))
                if len(commits) == 2:  # At most two batches in memory.
                    await commits.pop(0)
            await asyncio.gather(*commits)
            await asyncio.gather(*flushes)
        except BaseException:
            await settle(commits)
            await settle(flushes)
            raise

    async def _flush_when(
        self,
        commit: ts.Future[None],
        database: epath.Path | None,
        flushes: list[asyncio.Future[Any]],
    ) -> None:
        """Waits for ``commit``, then starts flushing the data files of ``database`` (if
        given): the disk writes them while later batches are staged, not all at the
        checkpoint's commit (a committed batch holds no memory: the flush delays nothing)."""
        await commit
        if database is not None:
            flush = asyncio.to_thread(_fsync_new_files, database, self._flushed)
            flushes.append(asyncio.ensure_future(flush))

    async def _start_large(
        self,
        large: Sequence[ArrayWrite],
        database: epath.Path,
        kvstore: ts.KvStore,
        context: ts.Context,
    ) -> list[asyncio.Future[Any]]:
        """Starts writing the large arrays in groups, each committed by one of the writers."""
        groups = _batches(large, LARGE_GROUP_BYTES)
        writers = _writer_databases(database, len(groups))
        stores = {database: kvstore}
        for writer in writers:
            if writer != database:
                stores[writer] = await _ocdbt.open_kvstore(writer, context, create=True)
        limiter = ByteLimiter(IN_FLIGHT_BYTES)
        committed = [asyncio.get_running_loop().create_future() for _ in groups]
        tasks = [
            asyncio.ensure_future(
                self._write_large(
                    group, writers[n % len(writers)], stores, context, limiter, committed[n]
                )
            )
            for n, group in enumerate(groups)
        ]
        if writers != [database]:
            # Merged as soon as every group is committed, while the last ones are flushed.
            tasks.append(asyncio.ensure_future(_merge_when(committed, database, writers)))
        await asyncio.sleep(0)  # Let the large groups start before this thread encodes.
        return tasks

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
        committed: asyncio.Future[bool],
    ) -> None:
        """Writes a group of arrays through the zarr3 driver, as one OCDBT commit, then
        flushes its data files (while later groups are encoded, rather than all at the
        checkpoint's commit). ``committed`` says whether the commit succeeded."""
        try:
            await self._commit_large(items, kvstores[database], context, limiter)
        except BaseException:
            committed.set_result(False)  # Nothing to merge: this task reports the failure.
            raise
        committed.set_result(True)
        await asyncio.to_thread(_fsync_new_files, database, self._flushed)

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
                    # zarr.json is written with the small arrays' first batch.
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


def _stage_small(
    kvstore: ts.KvStore, items: Sequence[ArrayWrite], metadata_only: Sequence[ArrayWrite]
) -> ts.Transaction:
    """A transaction writing the keys of ``items`` and the ``zarr.json`` of ``metadata_only``."""
    transaction = ts.Transaction()
    write = kvstore.with_transaction(transaction).write
    for item in (*items, *metadata_only):
        if item.write_metadata:
            write(item.layout.name + "/zarr.json", item.zarr_json())
    chunk_key, encode, checksum = _zarr3.chunk_key, _zarr3.encode_shard, crc32c.crc32c
    # Plain loops: a comprehension costs a frame per array (most have one chunk).
    for item in items:
        layout = item.layout
        for index, data in item.chunks:
            chunk = _full_chunk(data, layout).reshape(-1).view(np.uint8)
            write(chunk_key(layout.name, index), encode(chunk, checksum(chunk)))
    return transaction


def _full_chunk(data: np.ndarray, layout: _zarr3.ZarrLayout) -> np.ndarray:
    """``data`` as a C-contiguous full chunk (edge chunks are padded with zeros)."""
    if data.shape != layout.chunk_shape:
        full = np.zeros(layout.chunk_shape, dtype=layout.dtype)
        full[tuple(slice(0, s) for s in data.shape)] = data
        return full
    return np.ascontiguousarray(data, dtype=layout.dtype)


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


def _writer_databases(database: epath.Path, groups: int) -> list[epath.Path]:
    """The databases that ``groups`` groups of large arrays are committed to."""
    writers = WRITERS if _ocdbt.is_local(database) else REMOTE_WRITERS
    if groups < 2 or writers < 2:
        return [database]
    return [database / f"{WRITER_PREFIX}{i}" for i in range(min(writers, groups))]


async def _merge_when(
    committed: Sequence[asyncio.Future[bool]], database: epath.Path, writers: Sequence[epath.Path]
) -> None:
    """Merges the writers' databases into ``database`` once every group is committed."""
    if all(await asyncio.gather(*committed)):  # Else a group failed: its own task reports it.
        sources = [_ocdbt.Source(w) for w in writers]
        await asyncio.to_thread(_ocdbt.merge_into, database, sources)


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
