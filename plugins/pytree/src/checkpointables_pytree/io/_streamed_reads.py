"""Loads under a host-memory budget (``cp.options.MemoryOptions``): arrays read piece by piece.

A large array is never whole on the host: each region its devices need is cut
into pieces of at most ``piece_bytes`` (along the stored chunk grid where it
can), each piece is read by TensorStore's zarr3 driver (which checks its
CRC-32C) and handed at once to the read's ``PieceSink``, which puts it on the
devices (into a buffer there) and says when the host copy may go. A
``ByteLimiter`` of the budget bounds the pieces in flight. Small arrays are
read by the reader's usual paths, a window of them at a time. Arrays this
library wrote are read as byte ranges of their chunks instead, where the
b-tree locates them (``_ranged_reads``); the sinks and the pieces' sizes
are defined here for both.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np
import tensorstore as ts

from checkpointables_pytree import storage
from checkpointables_pytree.io._array_reads import (
    ArrayRead,
    Region,
    open_stored,
    read_region,
    region_shape,
)
from checkpointables_pytree.storage import ByteLimiter, gather_settled

__all__ = [
    "PieceSink",
    "PieceDestinations",
    "piece_bytes",
    "window_bytes",
    "pieces",
    "stream",
    "streams",
    "in_windows",
]

# A piece is held up to three times while read: the stored value, the decoded chunk, the copy
# the driver returns.
_COPIES = 3


@runtime_checkable
class PieceSink(Protocol):
    """Where the pieces of one streamed read go (made by a ``ReadTarget``'s ``sink``)."""

    def put(self, n: int, offset: tuple[int, ...], data: np.ndarray) -> Any:
        """Places ``data`` at ``offset`` in region ``n``; returns what to wait for before the
        host copy may be freed or reused (``jax.block_until_ready`` of it), or ``None``.
        ``data`` may be a view of a buffer the reader reuses: keep a copy, never ``data``.
        Puts into one region come one at a time; puts into distinct regions may come from
        several threads at once."""

    def finish(self) -> Any:
        """The leaf, once every piece was put."""


@runtime_checkable
class PieceDestinations(Protocol):
    """A ``PieceSink`` whose regions are host buffers a piece can be read straight into."""

    def destination(
        self, n: int, offset: tuple[int, ...], shape: tuple[int, ...]
    ) -> np.ndarray | None:
        """The part of region ``n`` at ``offset`` of ``shape``, writable and C-contiguous, to
        read a piece of the stored dtype into (then no ``put`` for it); ``None`` where it is
        not one block of memory, or the region is of another dtype."""


SinkFactory = Callable[[list[Region], np.dtype], PieceSink]


def piece_bytes(host_bytes: int) -> int:
    """The largest piece of an array moved at once under a budget of ``host_bytes``: an
    eighth (the driver may hold the chunks a piece touches besides the piece itself,
    and several pieces are in flight)."""
    return max(1 << 20, host_bytes // 8)


def window_bytes(host_bytes: int) -> int:
    """Bytes of small arrays read (and converted) together under a budget: a quarter (a
    resharded array is held up to three times while it is converted)."""
    return max(1 << 20, host_bytes // 4)


# Resharded arrays from this size on are streamed (read whole, they are held three times).
RESHARDED_STREAM_BYTES = 1 << 20


def streams(read: ArrayRead, most: int, *, ranged: bool = False) -> bool:
    """Whether a budgeted load streams ``read``: arrays larger than a piece (``most``), or
    of at least ``RESHARDED_STREAM_BYTES`` and either of a sharded target (regions) or
    stored directly where ``ranged`` reads are possible (read straight into the result)."""
    if read.sink is None:
        return False
    if read.stored is None:
        return True
    nbytes = read.stored.nbytes
    others = read.regions is not None or (ranged and read.stored.direct)
    return nbytes > most or (others and nbytes >= RESHARDED_STREAM_BYTES)


def in_windows(reads: Sequence[ArrayRead], window: int) -> Iterator[list[ArrayRead]]:
    """``reads`` in runs of about ``window`` stored bytes (one larger read alone)."""
    batch: list[ArrayRead] = []
    used = 0
    for read in reads:
        nbytes = read.stored.nbytes if read.stored is not None else window
        if batch and used + nbytes > window:
            yield batch
            batch, used = [], 0
        batch.append(read)
        used += nbytes
    if batch:
        yield batch


def _piece_shape(region: Region, chunk_shape: Sequence[int], itemsize: int, most: int) -> list[int]:
    """The shape pieces of ``region`` take: the region, shortened along its first axes until
    a piece is at most ``most`` bytes, in whole chunks where a chunk fits."""
    shape = list(region_shape(region))
    for d in range(len(shape)):
        nbytes = math.prod(shape) * itemsize
        if nbytes <= most:
            break
        unit = nbytes // shape[d]  # Bytes of one index along axis d.
        rows = most // unit
        if rows >= 1:
            chunk = int(chunk_shape[d]) if d < len(chunk_shape) else 1
            shape[d] = rows // chunk * chunk if rows >= chunk else rows
            break
        shape[d] = 1
    return shape


def _tiles(region: Region, step: Sequence[int], grid: Sequence[int]) -> Iterator[Region]:
    """``region`` cut at the multiples of ``grid`` (absolute), each cell in tiles of ``step``."""

    def cuts(r: slice, s: int, g: int) -> list[slice]:
        out = []
        start = r.start
        while start < r.stop:
            cell_end = min(r.stop, (start // g + 1) * g)
            while start < cell_end:
                out.append(slice(start, min(start + s, cell_end)))
                start = out[-1].stop
        return out

    per_axis = [cuts(r, s, g) for r, s, g in zip(region, step, grid, strict=True)]
    yield from itertools.product(*per_axis)


def pieces(
    region: Region, chunk_shape: Sequence[int], itemsize: int, most: int
) -> Iterator[Region]:
    """The pieces of ``region``: its parts in each stored chunk, a part larger than ``most``
    bytes cut along its first axes (each piece then touches one chunk), in C order."""
    if not region:
        yield region
        return
    grid = [max(1, int(c)) for c in chunk_shape]
    cell = tuple(slice(0, min(g, r.stop - r.start)) for g, r in zip(grid, region, strict=True))
    step = _piece_shape(cell, [1] * len(grid), itemsize, most)
    yield from _tiles(region, step, grid)


def _settle_piece(pending: Any) -> None:
    """Waits until the device holds a piece, then frees the host's memory of it."""
    if pending is not None:
        jax.block_until_ready(pending)
    storage.give_back_free_memory()


async def stream(
    read: ArrayRead,
    spec: dict[str, Any],
    context: ts.Context,
    limiter: ByteLimiter,
    most: int,
    directory: Any = "",
) -> None:
    """Reads ``read`` piece by piece through the zarr3 driver into its sink, at most
    ``limiter``'s bytes in flight (``directory``: the pytree's, which errors name)."""
    opened = await open_stored(read, spec, context, directory)
    store, stored_shape, dtype, regions = opened.store, opened.shape, opened.dtype, opened.regions
    read_chunk = store.chunk_layout.read_chunk.shape or stored_shape
    chunk_shape = tuple(int(c or 1) for c in read_chunk)
    assert read.sink is not None
    sink: PieceSink = read.sink(regions, dtype)

    async def one(n: int, piece: Region) -> None:
        nbytes = math.prod(region_shape(piece)) * dtype.itemsize
        async with limiter.hold(_COPIES * nbytes):
            data = await read_region(read, store, piece, stored_shape)
            offset = tuple(p.start - r.start for p, r in zip(piece, regions[n], strict=True))
            pending = sink.put(n, offset, data)
            del data
            # The device holds its own copy before this one goes.
            await asyncio.to_thread(_settle_piece, pending)

    tasks = [
        asyncio.ensure_future(one(n, piece))
        for n, region in enumerate(regions)
        for piece in pieces(region, chunk_shape, dtype.itemsize, most)
    ]
    await gather_settled(tasks)
    read.result = sink.finish()
