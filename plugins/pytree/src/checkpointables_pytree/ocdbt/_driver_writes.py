"""Arrays written through TensorStore's zarr3 driver, by several OCDBT writers.

The arrays the writer does not encode itself (larger than it takes, compressed,
in inner chunks, int4...) are grouped into transactions of about
``LARGE_GROUP_BYTES``, committed by up to ``WRITERS`` OCDBT writers (databases
of their own, ``ocdbt.writer_<i>``, merged into the pytree's database at the
end; a single group commits into the pytree's database itself, once that is
written). Each group's data files are flushed while later groups are encoded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, TypedDict

import tensorstore as ts
from etils import epath

from checkpointables_pytree import storage
from checkpointables_pytree.ocdbt import _context
from checkpointables_pytree.storage import ByteLimiter
from checkpointables_pytree.zarr3 import ArrayWrite

__all__ = ["DriverWrites", "LARGE_GROUP_BYTES", "WRITER_PREFIX"]

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


class _MetadataOptions(TypedDict, total=False):
    """The keyword arguments of ``ts.open`` that say how it treats an array's ``zarr.json``."""

    create: bool
    assume_metadata: bool


class DriverWrites:
    """The arrays of one save written through the zarr3 driver."""

    def __init__(self, *, write_metadata: bool = False) -> None:
        """``write_metadata``: the driver writes the ``zarr.json`` of the arrays that
        record it (else the caller's own database holds them)."""
        self._write_metadata = write_metadata
        self._flushed: set[str] = set()
        self._specs: dict[tuple[Any, ...], ts.Spec] = {}
        # The pytree's database, and the writing of it that its commits wait for.
        self._database_written: tuple[epath.Path, asyncio.Future[None]]

    async def start(
        self,
        large: Sequence[ArrayWrite],
        database: epath.Path,
        context: ts.Context,
        database_written: asyncio.Future[None],
    ) -> list[asyncio.Future[Any]]:
        """Starts writing ``large`` in groups, each committed by one of the writers into (or
        then merged into) ``database``, whose own writing is ``database_written``; returns
        the tasks to await."""
        groups = _batches(large, LARGE_GROUP_BYTES)
        writers = _writer_databases(database, len(groups))
        stores = {}
        for writer in writers:
            stores[writer] = await _context.open_kvstore(writer, context, create=True)
        limiter = ByteLimiter(IN_FLIGHT_BYTES)
        committed = [asyncio.get_running_loop().create_future() for _ in groups]
        tasks: list[asyncio.Future[Any]] = [
            asyncio.ensure_future(
                self._write_large(
                    group, writers[n % len(writers)], stores, context, limiter, committed[n]
                )
            )
            for n, group in enumerate(groups)
        ]
        self._database_written = (database, database_written)
        if writers != [database]:
            # Merged as soon as every group is committed, while the last ones are flushed.
            merge = _merge_when(committed, database_written, database, writers)
            tasks.append(asyncio.ensure_future(merge))
        await asyncio.sleep(0)  # Let the large groups start before this thread encodes.
        return tasks

    def _zarr3_spec(self, item: ArrayWrite) -> ts.Spec:
        """The zarr3 spec of ``item`` (without its kvstore), parsed once per distinct layout."""
        layout = item.layout
        key: tuple[Any, ...] = (
            layout.shape,
            layout.dtype,
            layout.chunk_shape,
            item.inner_chunk_shape,
        )
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

    def _metadata_options(self, item: ArrayWrite) -> _MetadataOptions:
        """How ``ts.open`` treats the array's ``zarr.json``: written by the caller's own
        database (assumed here), or created here (with the array's first chunks)."""
        if self._write_metadata and item.write_metadata:
            return {"create": True}
        return {"assume_metadata": True}

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
        root, root_written = self._database_written
        after = root_written if database == root else None
        try:
            await self._commit_large(items, kvstores[database], context, limiter, after)
        except BaseException:
            committed.set_result(False)  # Nothing to merge: this task reports the failure.
            raise
        committed.set_result(True)
        await asyncio.to_thread(_context.flush_data_files, database, self._flushed)

    async def _commit_large(
        self,
        items: Sequence[ArrayWrite],
        base: ts.KvStore,
        context: ts.Context,
        limiter: ByteLimiter,
        after: asyncio.Future[None] | None,
    ) -> None:
        """Opens, writes and commits one group of arrays in the database ``base`` opens,
        once ``after`` (if given: the writing of that database itself) is done."""
        # A group of several arrays is one transaction: one commit instead of one each.
        transaction = ts.Transaction() if len(items) > 1 or after is not None else None
        # Opened all at once, before waiting for the byte limit (an open holds no data),
        # from parsed specs and an open kvstore: a JSON spec costs twice as much.
        stores = await storage.wait_all(
            [
                ts.open(
                    self._zarr3_spec(item),
                    kvstore=base / (item.layout.name + "/"),
                    **self._metadata_options(item),
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
                await storage.wait_all(futures)
            else:
                await storage.wait_all([f.copy for f in futures])
                if after is not None:
                    await asyncio.wait([after])
                    if after.exception() is not None:
                        return  # The database was not written: that task reports why.
                await transaction.commit_async()


def _writer_databases(database: epath.Path, groups: int) -> list[epath.Path]:
    """The databases that ``groups`` groups of large arrays are committed to."""
    writers = WRITERS if _context.is_local(database) else REMOTE_WRITERS
    if groups < 2 or writers < 2:
        return [database]
    return [database / f"{WRITER_PREFIX}{i}" for i in range(min(writers, groups))]


async def _merge_when(
    committed: Sequence[asyncio.Future[bool]],
    database_written: asyncio.Future[None],
    database: epath.Path,
    writers: Sequence[epath.Path],
) -> None:
    """Merges the writers' databases into ``database`` once every group is committed and
    the database itself is written."""
    done = await asyncio.gather(*committed)
    await asyncio.wait([database_written])  # If it failed, its own task reports it.
    if all(done) and not database_written.exception():  # Else that failure is reported.
        sources = [_context.Source(w) for w in writers]
        await asyncio.to_thread(_context.merge_into, database, sources)


def _batches(items: Sequence[ArrayWrite], budget: int) -> list[list[ArrayWrite]]:
    """``items`` in runs of about ``budget`` bytes (a larger item alone)."""
    batches: list[list[ArrayWrite]] = [[]]
    used = 0
    for item in items:
        nbytes = item.nbytes
        if batches[-1] and used + nbytes > budget:
            batches.append([])
            used = 0
        batches[-1].append(item)
        used += nbytes
    return [b for b in batches if b]
