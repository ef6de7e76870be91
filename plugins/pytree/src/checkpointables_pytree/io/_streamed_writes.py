"""Saves under a host-memory budget (``cp.options.MemoryOptions``): chunks copied and written
one window at a time.

A streamed array's ``ArrayWrite`` holds no data (the writer writes its
``zarr.json`` with the others); its ``ChunkSource``s say how each chunk is
fetched to the host (a slice of a shard, read from the device only when its
turn comes). ``write_streamed`` fetches chunks while a ``ByteLimiter`` of the
budget lets them, hands each to TensorStore's zarr3 driver (which encodes it,
with its CRC-32C, into the pytree's database) and frees it once committed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import tensorstore as ts
from etils import epath

from checkpointables_pytree import ocdbt, storage
from checkpointables_pytree.io._staging import Staging
from checkpointables_pytree.storage import ByteLimiter, settle
from checkpointables_pytree.zarr3 import ArrayWrite

__all__ = ["ChunkSource", "Streamed", "write_streamed"]

# A chunk is held up to twice while it is written: fetched (TensorStore references it rather
# than copying it: it is kept until its write is committed) and encoded.
_COPIES = 2


@attrs.frozen
class ChunkSource:
    """One chunk of a streamed array: its index and how to fetch its data to the host."""

    index: tuple[int, ...]
    nbytes: int
    fetch: Callable[[], np.ndarray]


@attrs.frozen
class Streamed:
    """An array written chunk by chunk: its write (layout, codecs; no data) and its chunks."""

    item: ArrayWrite
    sources: Sequence[ChunkSource]


async def write_streamed(
    streams: Sequence[Streamed],
    database: epath.Path,
    context: ts.Context,
    host_bytes: int,
    staging: Staging,
) -> None:
    """Writes every chunk of ``streams`` into ``database`` (whose ``zarr.json``s are written),
    at most ``host_bytes`` held at once (counted in ``staging``); flushes the data files."""
    if not streams:
        return
    base = await ocdbt.open_kvstore(database, context)
    limiter = ByteLimiter(host_bytes)

    async def one(store: Any, item: ArrayWrite, source: ChunkSource) -> None:
        async with limiter.hold(_COPIES * source.nbytes):
            with staging.held(_COPIES * source.nbytes):
                data = await asyncio.to_thread(source.fetch)
                region = item.layout.region(source.index)
                target = store if data.shape == item.layout.shape else store[region]
                await target.write(data, can_reference_source_data_indefinitely=True)
                del data
                await asyncio.to_thread(storage.give_back_free_memory)

    tasks: list[asyncio.Future[Any]] = []
    try:
        for stream in streams:
            item = stream.item
            store = await ts.open(
                {"driver": "zarr3", "metadata": item.metadata()},
                kvstore=base / (item.layout.name + "/"),
                assume_metadata=True,
                context=context,
            )
            tasks += [asyncio.ensure_future(one(store, item, s)) for s in stream.sources]
        await asyncio.gather(*tasks)
    except BaseException:
        await settle(tasks)
        raise
    await asyncio.to_thread(ocdbt.flush_data_files, database, set())
