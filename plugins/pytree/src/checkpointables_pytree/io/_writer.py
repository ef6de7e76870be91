"""The writer: every array of one save, written in one ``Writer.run``.

Leaf handlers ``add`` an ``ArrayWrite`` (``_zarr3``) per leaf (its layout, and the host
data of the chunks this process owns); ``run`` then writes them all into the
pytree's OCDBT database:

* plain arrays (uncompressed, one inner chunk per shard, of a dtype stored as
  little-endian bytes) are encoded here into the exact keys TensorStore's
  zarr3 driver would write (``<name>/zarr.json`` and one shard per chunk:
  the data, its CRC-32C, the shard index, see ``_zarr3``). With every array's
  ``zarr.json`` they make the pytree's database, which ``_direct_database``
  writes without TensorStore, in data files of up to ``DATA_FILE_BYTES``
  written from the arrays' own memory, each as soon as its arrays are
  encoded. Its layout is made once per tree structure. Only arrays up to
  ``DIRECT_BYTES`` are (on an object store ``REMOTE_DIRECT_BYTES``: each
  data file is one PUT of a copy; but an incremental save's, whose arrays of any
  size come here to get files of their own: a file over 16 MiB is uploaded in
  bounded parts, ``storage.upload_in_parts``);
* the others (larger, compressed, finely chunked, int4...) go through the zarr3
  driver (``_driver_writes``).

Measured against TensorStore's own writer (``docs/performance.md``): an OCDBT
transaction costs about 7 us per key and copies each value, a zarr3 driver
about 150 us of Python per array and its CRC-32C is portable code. Everything
of one save shares one ``ts.Context``.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import operator
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import checkpointables as cp
import numpy as np
import tensorstore as ts
from checkpointables import execution
from etils import epath

from checkpointables_pytree import ocdbt, storage, zarr3
from checkpointables_pytree.io._staging import Staging
from checkpointables_pytree.io._streamed_writes import Streamed, write_streamed
from checkpointables_pytree.storage import settle
from checkpointables_pytree.zarr3 import ArrayWrite

__all__ = ["Writer", "DIRECT_BYTES"]

# Plain arrays up to this size are encoded here (256 MiB in 256 arrays: 110 ms of CPU, 190 via
# the driver); 1 GiB in 16 arrays saved in 425 ms via the driver's 4 writers, 621 ms here.
DIRECT_BYTES = 32 << 20
# On an object store a data file is one PUT of a copy; TensorStore's writers keep 16 PUTs going.
REMOTE_DIRECT_BYTES = 1 << 20
# Arrays per data file: one is written (and flushed) while the next is encoded. The first
# files are smaller (2 MiB, then twice the previous): the disk starts early, and a large
# save still has few files.
DATA_FILE_BYTES = 32 << 20
FIRST_DATA_FILE_BYTES = 2 << 20
# On an object store a data file is joined into one copy and TensorStore makes two more
# (one while PUT): two in flight of 32 MiB grew a 256 MiB save's RSS by 0.42x its size.
# One at a time, of 16 MiB: a load of a few thousand small arrays still needs few GETs.
REMOTE_DATA_FILE_BYTES = 16 << 20
# Chunks over this size get their CRC-32C in the thread writing their file, smaller ones
# while they are encoded (a call's Python costs more than 64 KiB of checksum).
DEFERRED_CRC_BYTES = 64 << 10

DATABASE_LAYOUT = "database layout"  # The structure cache's key of the last layout.
_LAYOUT = operator.attrgetter("layout")
_WRITE_METADATA = operator.attrgetter("write_metadata")
_CHUNKS = operator.attrgetter("chunks")


class Writer:
    """Collects the arrays of one save, then writes them all (``run``)."""

    def __init__(
        self,
        directory: cp.path.PathAwaitingCreation,
        structure_cache: dict[Any, Any] | None = None,
        *,
        fast_path: bool = True,
        host_bytes: int | None = None,
    ) -> None:
        """A writer into ``directory``; what depends only on the tree's structure is kept
        in ``structure_cache`` (``tree.Structure.derived``) for the next save.

        ``fast_path``: plain arrays go into a database written here
        (``ocdbt.DatabaseFiles``); ``False`` hands every array to TensorStore's zarr3
        driver, which writes their ``zarr.json`` and the database itself.
        ``host_bytes``: the host-memory budget of streamed arrays (``add_streamed``).
        """
        self._host_bytes = host_bytes
        self._streams: list[Streamed] = []
        # What the save holds on the host for writing (leaf handlers count their copies).
        self.staging = Staging()
        self._directory = directory
        self._fast_path = fast_path
        self._items: list[ArrayWrite] = []
        self._structure_cache = structure_cache if structure_cache is not None else {}
        # Incremental saves (``reuse``): arrays whose chunk keys are linked from an earlier
        # checkpoint's data files, by name; and whether each array gets files of its own,
        # but for the arrays ``shared``, by group: consecutive arrays of one group share
        # files (those declared frozen, always linked together: fewer links for the next
        # save to make; those written at every save, never linked: fewer files to flush).
        # Only the arrays a later save may link (``linkable``) start files: the others (small
        # arrays, rewritten at every save) fill the file being written, as without reuse.
        self.linked: dict[str, list[tuple[str, ocdbt.Linked]]] = {}
        self.isolate = False
        self.shared: dict[str, str] = {}
        self.linkable: frozenset[str] = frozenset()

    def add(self, item: ArrayWrite) -> None:
        """Schedules ``item``; nothing is written before ``run``."""
        self._items.append(item)

    def add_streamed(self, stream: Streamed) -> None:
        """Schedules an array written chunk by chunk, after the others, within the budget
        (its ``item``, without data, must be ``add``ed too: its ``zarr.json``)."""
        self._streams.append(stream)

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
        with storage.object_store_failures(self._directory.path, "Writing the arrays to"):
            root = await self._directory.await_creation()
            database = ocdbt.database_directory(root)
            context = ocdbt.make_context(ocdbt.SAVE_OCDBT_CACHE_BYTES)
            local = ocdbt.is_local(database)
            limit = DIRECT_BYTES if local else REMOTE_DIRECT_BYTES
            here: list[ArrayWrite] = []
            driver: list[ArrayWrite] = []
            linked: list[ArrayWrite] = []
            for item in self._items:
                if item.layout.name in self.linked:
                    linked.append(item)
                    continue
                # Reusable arrays go into files of their own: into the fast path's.
                fast = item.plain and (self.isolate or item.largest <= limit)
                (here if self._fast_path and fast else driver).append(item)
            written = asyncio.ensure_future(
                self._write_database(database, context, here, [*driver, *linked])
            )
            tasks: list[asyncio.Future[Any]] = [written]
            try:
                # TensorStore's threads encode those arrays while this thread encodes these.
                large = ocdbt.DriverWrites(write_metadata=not self._fast_path)
                tasks += await large.start(driver, database, context, written)
                await asyncio.gather(*tasks)
            except BaseException:
                await settle(tasks)
                raise
            if self._streams:
                assert self._host_bytes is not None
                await write_streamed(
                    self._streams, database, context, self._host_bytes, self.staging
                )

    async def _write_database(
        self,
        database: epath.Path,
        context: ts.Context,
        here: Sequence[ArrayWrite],
        driver: Sequence[ArrayWrite],
    ) -> None:
        """Writes the pytree's database: the arrays encoded ``here``, and the ``zarr.json`` of
        those and of the arrays written by the ``driver``.

        Each data file is written (and flushed) as soon as its arrays are
        encoded, the b-tree once all are, in a file of its own. The manifest is
        written last. Without the fast path TensorStore writes all of it.
        """
        if not self._fast_path:
            return
        files = await ocdbt.DatabaseFiles.open(database, context)
        layout = self._database_layout(here, driver, files.local)
        if layout is None:
            return
        names = layout.file_names()
        values: list[Sequence[Any]] = []
        chunks = _chunk_values(here)
        writes: list[asyncio.Future[Any]] = []
        if self.linked:  # Beside the writes of this save's own data files (other names),
            # submitted to the executor before them.
            links = [value for item in self.linked.values() for _, value in item]
            loop = asyncio.get_running_loop()
            caller = contextvars.copy_context()  # The storage options reach the copies.
            writes.append(loop.run_in_executor(None, caller.run, ocdbt.link_files, database, links))
        try:
            for n in range(layout.data_files):
                with execution.paused_gc():
                    values.extend(itertools.islice(chunks, layout.needs(n) - len(values)))
                # A local file holds no copy: all are written at once. A remote one is
                # copies: one is PUT while the next is encoded.
                if not files.local and writes:
                    await writes.pop(0)
                writes.append(self._start(files, layout.data_file(n, names, values)))
            with execution.paused_gc():
                values.extend(chunks)
            btree, manifest = layout.btree_file(names, values)
            # A b-tree of inline values only is small: the commit flushes it with the rest.
            writes.append(files.start(btree, flush=layout.data_files > 0))
            await asyncio.gather(*writes)
            # The checkpoint's commit flushes the manifest with its other files.
            manifest_file = ocdbt.DataFile(ocdbt.MANIFEST_FILE, [manifest])
            await files.start(manifest_file, flush=False)
        except BaseException:
            await settle(writes)
            raise

    def _start(self, files: ocdbt.DatabaseFiles, file: ocdbt.DataFile) -> asyncio.Future[Any]:
        """Starts writing a data file (flushed). What a remote one holds (a joined copy and
        TensorStore's own while it is PUT, or a few parts of a large one) counts as staged
        until it is written."""
        if files.local:
            return files.start(file, flush=True)
        nbytes = files.held_bytes(file)
        self.staging.hold(nbytes)
        written = files.start(file, flush=True)
        written.add_done_callback(lambda _: self.staging.release(nbytes))
        return written

    def _database_layout(
        self, here: Sequence[ArrayWrite], driver: Sequence[ArrayWrite], local: bool
    ) -> ocdbt.DatabaseLayout | None:
        """The layout of the database of ``here`` and ``driver`` (``None`` if it has no key):
        kept with the tree's structure, and made again when the arrays' layouts, the chunks
        this process writes or the storage differ from the last save's."""
        items = [*here, *driver]
        if self.linked or self.isolate:  # Made for this save's links and files.
            keys = _database_keys(here, driver, self.linked, self.shared, self.linkable)
            return _layout(*keys, local, self.isolate, self._host_bytes)
        signature = (
            local,
            self._host_bytes,
            len(here),
            list(map(_LAYOUT, items)),
            list(map(_WRITE_METADATA, items)),
            [c[0][0] if len(c) == 1 else [i for i, _ in c] for c in map(_CHUNKS, here)],
        )
        kept = self._structure_cache.get(DATABASE_LAYOUT)
        if kept is not None and kept[0] == signature:
            return kept[1]  # type: ignore[no-any-return]
        layout = _layout(*_database_keys(here, driver), local, host_bytes=self._host_bytes)
        self._structure_cache[DATABASE_LAYOUT] = (signature, layout)
        return layout


def _layout(
    keys: list[str],
    lengths: list[int],
    fixed: list[Any],
    breaks: frozenset[int],
    local: bool,
    isolate: bool = False,
    host_bytes: int | None = None,
) -> ocdbt.DatabaseLayout | None:
    """The layout of a database of ``keys`` (``None`` if none); ``isolate``: each array's
    chunks start a data file (``breaks``), so that a later save can link it whole. Under a
    budget of ``host_bytes`` a remote data file (held twice while PUT) is a quarter of it
    at most."""
    if not keys:
        return None
    sizes = {"file_bytes": DATA_FILE_BYTES, "first_file_bytes": FIRST_DATA_FILE_BYTES}
    if not local:
        most = REMOTE_DATA_FILE_BYTES if host_bytes is None else host_bytes // 4
        sizes = {"file_bytes": min(REMOTE_DATA_FILE_BYTES, most)}
    return ocdbt.DatabaseLayout(
        keys, lengths, fixed, **sizes, breaks=breaks if isolate else frozenset()
    )


def _database_keys(
    here: Sequence[ArrayWrite],
    driver: Sequence[ArrayWrite],
    linked: dict[str, list[tuple[str, ocdbt.Linked]]] | None = None,
    shared: Mapping[str, str] | None = None,
    linkable: Collection[str] = (),
) -> tuple[list[str], list[int], list[Any], frozenset[int]]:
    """The keys of the database, their values' lengths, the values that are fixed (every
    array's ``zarr.json``, the ``linked`` chunks), then the chunks of those encoded
    ``here`` (given each save); and the positions where a ``linkable`` array's chunks
    start (but where it follows an array of its group of ``shared`` files)."""
    keys: list[str] = []
    lengths: list[int] = []
    fixed: list[Any] = []
    breaks = set()
    for item in (*here, *driver):
        if item.write_metadata:
            text = item.zarr_json()
            keys.append(item.layout.name + "/zarr.json")
            lengths.append(len(text))
            fixed.append(text)
    for values in (linked or {}).values():
        for key, value in values:
            keys.append(key)
            lengths.append(value.length)
            fixed.append(value)
    shared = shared or {}
    previous = None  # The group of the array before (``None``: files of its own).
    for item in here:
        if item.layout.name in linkable:
            group = shared.get(item.layout.name)
            if group is None or group != previous:
                breaks.add(len(keys))
            previous = group
        for index, _ in item.chunks:
            keys.append(zarr3.chunk_key(item.layout.name, index))
            lengths.append(item.layout.chunk_nbytes + zarr3.SHARD_TRAILER_BYTES)
            fixed.append(None)
    return keys, lengths, fixed, frozenset(breaks)


def _chunk_values(items: Sequence[ArrayWrite]) -> Iterator[tuple[np.ndarray, Any]]:
    """Every chunk of ``items`` as a zarr3 shard of one inner chunk: the data, then its end.

    A large shard's end (the chunk's CRC-32C, the index) is computed by the thread that
    writes its file (``_direct_database.Deferred``): checksums of one file overlap the
    next's encoding. A small one's is computed here: in the writing thread its Python
    would wait for the GIL this thread holds.
    """
    deferred, end, full_chunk = ocdbt.Deferred, zarr3.shard_end, zarr3.full_chunk
    for item in items:
        layout = item.layout
        for _, data in item.chunks:
            chunk = full_chunk(data, layout).reshape(-1).view(np.uint8)
            yield chunk, deferred(end, chunk) if chunk.nbytes > DEFERRED_CRC_BYTES else end(chunk)
