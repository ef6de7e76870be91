"""Streamed loads of arrays this library wrote: each stored chunk read as byte ranges.

An array stored uncompressed with one inner chunk per shard
(``StoredArray.direct``) keeps each zarr3 chunk as one value of the
database: the chunk's C-order bytes, their CRC-32C, then the shard index
(``zarr3.encode_shard``). A part of a chunk that fixes its leading indices
and spans a range of the next axis (and all of the later ones) is a
contiguous range of those bytes, so a piece of at most ``most`` bytes is
read on its own, straight from the data file the b-tree names (``preadv``
into a reused buffer; a ranged GET on an object store), whatever the chunk's
size: a chunk of a checkpoint saved without a budget is never whole on the
host.

What is verified: a chunk's CRC-32C covers the whole chunk. Each chunk the
load needs is read front to back, piece after piece, and its CRC-32C is
computed over the pieces as they pass (the bytes of a chunk no region needs
are read for the checksum only); the shard index after the data is checked
before the first piece. Pieces are put on their devices as they arrive, but
the leaf is handed out only once every chunk it was built from matched its
CRC-32C: a mismatch fails the load (``cp.errors.IntegrityError``) and what
was put is dropped. With ``verify=False`` only the pieces some region needs
are read, and nothing is checked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import os
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import crc32c
import jax
import numpy as np

from checkpointables_pytree import ocdbt, storage, zarr3
from checkpointables_pytree.io._array_reads import ArrayRead, Region, region_shape
from checkpointables_pytree.io._small_reads import checksum_error, layout_error
from checkpointables_pytree.io._streamed_reads import PieceDestinations
from checkpointables_pytree.storage import ByteLimiter

__all__ = ["PieceBuffers", "RangeSource", "Shared", "chunk_pieces", "plan", "stream_ranges"]

_CRC = struct.Struct("<I")


@dataclasses.dataclass(frozen=True, slots=True)
class _Chunk:
    """One stored chunk a streamed read needs: its first element and where its value is."""

    index: tuple[int, ...]
    origin: tuple[int, ...]
    location: ocdbt.ValueLocation


def _inside(region: Region, shape: tuple[int, ...]) -> bool:
    return all(r.start >= 0 and r.stop <= s for r, s in zip(region, shape, strict=True))


def _overlap(a: Region, b: Region) -> Region | None:
    out = []
    for x, y in zip(a, b, strict=True):
        start, stop = max(x.start, y.start), min(x.stop, y.stop)
        if start >= stop:
            return None
        out.append(slice(start, stop))
    return tuple(out)


def plan(
    read: ArrayRead, regions: Sequence[Region], found: dict[bytes, Any]
) -> list[_Chunk] | None:
    """The chunks ``regions`` touch, each located by ``found`` (the b-tree's answer for
    ``read.chunk_keys``); ``None`` where ranges cannot be read (not stored directly, a region
    beyond the stored shape to pad with zeros, a value not where or of the size recorded)."""
    stored = read.stored
    if stored is None or not stored.direct or stored.nbytes == 0:
        return None
    if not all(region and _inside(region, stored.shape) for region in regions):
        return None
    size = stored.chunk_nbytes + zarr3.SHARD_TRAILER_BYTES
    chunks = []
    for index, key in zip(stored.chunk_indices, read.chunk_keys, strict=True):
        origin = tuple(i * c for i, c in zip(index, stored.chunk_shape, strict=True))
        limits = zip(origin, stored.chunk_shape, stored.shape, strict=True)
        box = tuple(slice(o, min(o + c, s)) for o, c, s in limits)
        if not any(_overlap(box, region) for region in regions):
            continue  # Another process's part, or truncated away.
        location = found.get(key)
        if type(location) is not ocdbt.ValueLocation or location.length != size:
            return None  # TensorStore's driver reads it, and reports what is wrong.
        chunks.append(_Chunk(index, origin, location))
    return chunks


def chunk_pieces(
    chunk_shape: Sequence[int], itemsize: int, most: int
) -> list[tuple[Region, int, int]]:
    """A chunk cut into contiguous pieces of at most ``most`` bytes (at least one element), in
    byte order: (the piece in the chunk, its first byte, its length in bytes)."""
    shape = [int(c) for c in chunk_shape]
    # The pieces fix the leading indices and span a range of one axis and all later axes.
    step = list(shape)
    for d in range(len(shape)):
        if math.prod(shape[d:]) * itemsize <= most:
            break  # The rest of the chunk fits in a piece.
        unit = math.prod(shape[d + 1 :]) * itemsize  # Bytes of one index along axis d.
        if unit <= most:
            step[d] = most // unit
            break
        step[d] = 1
    out = []
    position = 0
    for index in np.ndindex(*[-(-s // t) for s, t in zip(shape, step, strict=True)]):
        piece = tuple(
            slice(i * t, min((i + 1) * t, s)) for i, t, s in zip(index, step, shape, strict=True)
        )
        nbytes = math.prod(region_shape(piece)) * itemsize
        out.append((piece, position, nbytes))
        position += nbytes
    return out


class PieceBuffers:
    """Reused host buffers of ``size`` bytes for pieces: a fresh buffer pays a page fault
    per page (about 0.5 s per GiB here); the limiter bounds how many are out at once."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` (a pooled one when it fits)."""
        if nbytes > self.size:
            return storage.aligned_empty(nbytes)
        with self._lock:
            if self._free:
                return self._free.pop()
        return storage.aligned_empty(self.size)

    def give(self, buffer: np.ndarray) -> None:
        """Hands back a buffer from ``take`` (one of the pool's size is kept for reuse)."""
        if len(buffer) == self.size:
            with self._lock:
                self._free.append(buffer)


class RangeSource:
    """Reads byte ranges of the values the b-tree located: local files by ``preadv``, an
    object store's by ranged GETs."""

    def __init__(self, index: ocdbt.DatabaseIndex, local: bool) -> None:
        self._index = index
        self.local = local
        self.files = storage.OpenFiles()

    async def read(self, location: ocdbt.ValueLocation, start: int, into: np.ndarray) -> bool:
        """Fills ``into`` from byte ``start`` of the value at ``location``; ``False`` if the
        file ends first (or cannot be read)."""
        if self.local:
            return self.read_local(location, start, into)  # Small reads only: see _chunk.
        base = await self._index.base()
        key = os.path.relpath(location.file, self._index.root)
        first = location.offset + start
        try:
            result = await base.read(key, byte_range=slice(first, first + len(into)))
        except ValueError as e:
            if "OUT_OF_RANGE" not in str(e):
                raise
            return False  # A truncated object (the store refuses a range past its end).
        if result.state != "value" or len(result.value) != len(into):
            return False
        into[:] = np.frombuffer(result.value, np.uint8)
        return True

    def read_local(self, location: ocdbt.ValueLocation, start: int, into: np.ndarray) -> bool:
        """``read`` of a local file, in the calling thread."""
        try:
            fd = self.files.fd(location.file)
            # NumPy's stubs give ndarray a __buffer__ only on Python 3.12+ (mypy checks 3.11).
            storage.read_into(fd, [memoryview(into)], location.offset + start)  # type: ignore[arg-type]
        except (OSError, EOFError):
            return False
        return True

    def close(self) -> None:
        """Closes the files; call once no read uses them any more."""
        self.files.close()


class Shared:
    """What the streamed reads of one load share: the limit on the bytes in flight
    (``limiter``), the buffers, and how many chunks are read at once (enough to fill the
    limit; the other chunks wait here, not all on the limiter: each release would wake
    them all)."""

    def __init__(self, limiter: ByteLimiter, limit: int, piece: int) -> None:
        self.limiter = limiter
        self.buffers = PieceBuffers(piece)
        self.chunks = asyncio.Semaphore(max(2, limit // piece + 1))


@dataclasses.dataclass
class _Stream:
    """What the chunks of one streamed read share."""

    read: ArrayRead
    regions: Sequence[Region]
    sink: Any
    dtype: np.dtype
    locks: list[threading.Lock]  # One per region: a sink's puts into a region run one at a time.


async def stream_ranges(
    read: ArrayRead,
    regions: list[Region],
    chunks: list[_Chunk],
    source: RangeSource,
    shared: Shared,
    *,
    verify: bool,
) -> None:
    """Reads the ``chunks`` of ``read`` (from ``plan``) piece by piece into its sink."""
    stored = read.stored
    assert stored is not None and read.sink is not None
    state = _Stream(
        read,
        regions,
        read.sink(regions, stored.dtype),
        stored.dtype,
        [threading.Lock() for _ in regions],
    )
    cut = chunk_pieces(stored.chunk_shape, stored.dtype.itemsize, shared.buffers.size)
    tasks = [
        asyncio.ensure_future(_chunk(state, chunk, cut, source, shared, verify)) for chunk in chunks
    ]
    await storage.gather_settled(tasks)
    read.result = state.sink.finish()


async def _chunk(
    state: _Stream,
    chunk: _Chunk,
    cut: list[tuple[Region, int, int]],
    source: RangeSource,
    shared: Shared,
    verify: bool,
) -> None:
    """Reads one chunk front to back, its CRC-32C computed over the pieces as they pass."""
    async with shared.chunks:
        await _chunk_in_turn(state, chunk, cut, source, shared, verify)


async def _chunk_in_turn(
    state: _Stream,
    chunk: _Chunk,
    cut: list[tuple[Region, int, int]],
    source: RangeSource,
    shared: Shared,
    verify: bool,
) -> None:
    stored = state.read.stored
    assert stored is not None
    nbytes = stored.chunk_nbytes
    key = zarr3.chunk_key(state.read.name, chunk.index)
    trailer = np.empty(zarr3.SHARD_TRAILER_BYTES, np.uint8)
    if not await source.read(chunk.location, nbytes, trailer):
        raise layout_error(state.read, key, "is cut short")
    if trailer[4:].tobytes() != zarr3.shard_trailer(nbytes):
        raise layout_error(state.read, key)
    crc = 0
    for local, start, length in cut:
        piece = tuple(
            slice(o + p.start, o + p.stop) for o, p in zip(chunk.origin, local, strict=True)
        )
        targets = [
            (n, part)
            for n, region in enumerate(state.regions)
            if (part := _overlap(piece, region)) is not None
        ]
        if not targets and not verify:
            continue
        buffers = shared.buffers
        async with shared.limiter.hold(max(length, buffers.size)):  # What a buffer holds.
            if source.local:
                # A local file's piece is read in the worker thread too: one hand-over.
                fill = functools.partial(_fill, source, chunk.location, start, state.read, key)
                crc = await asyncio.to_thread(
                    _put_local, state, piece, targets, buffers, length, crc, verify, fill
                )
                continue
            buffer = buffers.take(length)
            try:
                data = buffer[:length]
                if not await source.read(chunk.location, start, data):
                    raise layout_error(state.read, key, "is cut short")
                crc = await asyncio.to_thread(_put, state, piece, targets, data, crc, verify)
            finally:
                buffers.give(buffer)
    # NumPy's stubs give ndarray a __buffer__ only on Python 3.12+ (mypy checks 3.11).
    if verify and crc != _CRC.unpack_from(trailer)[0]:  # type: ignore[arg-type]
        raise checksum_error(state.read)


def _fill(
    source: RangeSource,
    location: ocdbt.ValueLocation,
    start: int,
    read: ArrayRead,
    key: str,
    buffer: np.ndarray,
) -> None:
    """Reads a piece of a local file into ``buffer``."""
    if not source.read_local(location, start, buffer):
        raise layout_error(read, key, "is cut short")


def _destination(
    state: _Stream, piece: Region, targets: list[tuple[int, Region]]
) -> np.ndarray | None:
    """The bytes of the region's buffer a piece fills, where it lies whole in one region whose
    buffer takes it as one block; else ``None``."""
    if len(targets) != 1 or targets[0][1] != piece:
        return None
    if not isinstance(state.sink, PieceDestinations):
        return None
    n = targets[0][0]
    offset = tuple(p.start - r.start for p, r in zip(piece, state.regions[n], strict=True))
    with state.locks[n]:
        into = state.sink.destination(n, offset, region_shape(piece))
    return None if into is None else into.reshape(-1).view(np.uint8)


def _put_local(
    state: _Stream,
    piece: Region,
    targets: list[tuple[int, Region]],
    buffers: PieceBuffers,
    length: int,
    crc: int,
    verify: bool,
    fill: Callable[[np.ndarray], None],
) -> int:
    """Reads a piece of a local file with ``fill`` (in a worker thread): straight into the
    array being loaded where it is one block of it, else into a buffer, then ``_put``.
    Returns the CRC-32C so far."""
    into = _destination(state, piece, targets)
    if into is not None:  # No copy, and no buffer taken (a fresh one is a piece's memory).
        fill(into)
        # NumPy's stubs give ndarray a __buffer__ only on Python 3.12+ (mypy checks 3.11).
        return crc32c.crc32c(into, crc) if verify else crc  # type: ignore[arg-type]
    buffer = buffers.take(length)
    try:
        data = buffer[:length]
        fill(data)
        return _put(state, piece, targets, data, crc, verify)
    finally:
        buffers.give(buffer)


def _put(
    state: _Stream,
    piece: Region,
    targets: list[tuple[int, Region]],
    buffer: np.ndarray,
    crc: int,
    verify: bool,
) -> int:
    """Checksums a piece read into ``buffer`` and puts its parts into their regions (in a
    worker thread); waits until the devices hold them, so that the buffer may be reused.
    Returns the CRC-32C so far."""
    if verify:
        # NumPy's stubs give ndarray a __buffer__ only on Python 3.12+ (mypy checks 3.11).
        crc = crc32c.crc32c(buffer, crc)  # type: ignore[arg-type]
    data = buffer.view(state.dtype).reshape(region_shape(piece))
    pending = []
    for n, part in targets:
        region = state.regions[n]
        within_piece = tuple(
            slice(p.start - q.start, p.stop - q.start) for p, q in zip(part, piece, strict=True)
        )
        offset = tuple(p.start - r.start for p, r in zip(part, region, strict=True))
        with state.locks[n]:
            pending.append(state.sink.put(n, offset, data[within_piece]))
    pending = [p for p in pending if p is not None]
    if pending:
        jax.block_until_ready(pending)
    return crc
