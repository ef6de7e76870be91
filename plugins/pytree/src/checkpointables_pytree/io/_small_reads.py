"""Many small arrays of a local database, read and checked together with NumPy.

A load of 5,000 arrays of a few KiB spent about 10 us of Python per array
between the b-tree and the result: a buffer, a ``memoryview`` and an entry of
a ``preadv`` call, then the shard's layout and CRC-32C checked one by one
(``_read``). Arrays stored as one shard of one chunk, wanted whole, are read
here in bulk instead: their places in 64-byte aligned buffers come from one
cumulative sum, the values of one file in few ``preadv`` calls, and every
shard's trailer (the CRC-32C, the shard index and its CRC-32C) is checked for
all of them at once. What is left per array is its ``ndarray`` and its
CRC-32C.

Only arrays whose value the b-tree locates with exactly the recorded size
come here; a file that is missing or shorter than the b-tree says makes
``read`` return ``None``, and the caller reads those values through
TensorStore, which reports what is wrong.
"""

from __future__ import annotations

import functools
import itertools
import operator
import os
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeVar, cast

import crc32c
import numpy as np

from checkpointables_pytree import storage, zarr3
from checkpointables_pytree.io._array_reads import ArrayRead
from checkpointables_pytree.ocdbt import ValueLocation
from checkpointables_pytree.storage import ALIGNMENT, OpenFiles, aligned_empty, read_into

__all__ = [
    "MIN_BUFFER_BYTES",
    "SMALL_ARRAY_BYTES",
    "Small",
    "checksum_error",
    "in_groups",
    "layout_error",
    "groups",
    "read_small",
    "split",
]

# Arrays up to this size are read here (larger ones: a few, where Python per array is nothing).
SMALL_ARRAY_BYTES = 256 << 10
# The arrays of one call share one buffer: callers keep calls to about _local_reads.SLAB_BYTES,
# and to at least MIN_BUFFER_BYTES where they can: NumPy asks for 2 MiB pages from 4 MiB on,
# and the page faults of a buffer of 4 KiB pages cost about 0.5 ms per MiB.
MIN_BUFFER_BYTES = 4 << 20
# One preadv call reads at most this many values (the system's limit is 1024 buffers or more,
# with the gaps between them).
_VALUES_PER_CALL = 256
_GAP_BYTES = 64 << 10  # Read through gaps this small between two values of one file.
_TRAILER = zarr3.SHARD_TRAILER_BYTES
_SCRATCH = memoryview(bytearray(_GAP_BYTES))  # Gaps land here (threads share it: never read).
T = TypeVar("T")


class Small(NamedTuple):
    """A read taken by this module, and its one shard: inline in the b-tree, or where it is."""

    read: ArrayRead
    value: bytes | ValueLocation
    size: int  # Of the shard.


_VALUE = operator.itemgetter(1)
_SIZE = operator.itemgetter(2)


def in_groups(items: Sequence[T], sizes: Sequence[int], budget: int) -> list[list[T]]:
    """``items`` in order, cut into groups of about ``budget`` bytes (by ``sizes``)."""
    groups: list[list[T]] = [[]]
    used = 0
    for item, size in zip(items, sizes, strict=True):
        if groups[-1] and used >= budget:
            groups.append([])
            used = 0
        groups[-1].append(item)
        used += size
    return [g for g in groups if g]


def split(
    reads: Sequence[ArrayRead], keys: Sequence[tuple[bytes, ...]], found: dict[bytes, Any]
) -> tuple[list[Small], list[tuple[ArrayRead, tuple[bytes, ...]]]]:
    """The reads this module can do (small, one shard, wanted whole as stored), in the order
    of their shards in the files (inline ones last), and the rest with their shards' ``keys``.
    """
    small: list[Small] = []
    inline: list[Small] = []
    rest: list[tuple[ArrayRead, tuple[bytes, ...]]] = []
    # tuple.__new__ makes each Small without a Python frame: thousands per load.
    location_type, get, new = ValueLocation, found.get, tuple.__new__
    for read, read_keys in zip(reads, keys, strict=True):
        stored = read.stored
        if stored is not None and stored.single_chunk and read.regions is None:
            nbytes = stored.nbytes
            target = read.target_shape
            if 0 < nbytes <= SMALL_ARRAY_BYTES and (
                target is None or tuple(target) == stored.shape
            ):
                value: Any = get(read_keys[0])  # A ValueLocation, bytes or None: by kind.
                kind = type(value)
                if kind is location_type:
                    if value.length == nbytes + _TRAILER:
                        small.append(new(Small, (read, value, value.length)))
                        continue
                elif kind is bytes and len(value) == nbytes + _TRAILER:
                    inline.append(new(Small, (read, value, nbytes + _TRAILER)))
                    continue
        rest.append((read, read_keys))
    small.sort(key=_VALUE)  # By file, then offset.
    return small + inline, rest


def groups(small: list[Small], budget: int) -> list[list[Small]]:
    """``small`` (as ``split`` orders them) in groups of about ``budget`` bytes."""
    return in_groups(small, list(map(_SIZE, small)), budget)


def read_small(files: OpenFiles, smalls: Sequence[Small], verify: bool) -> list[np.ndarray] | None:
    """The arrays of ``smalls``, in order, in one buffer, checked (``verify``: their CRC-32Cs
    too); ``None`` if a file cannot be read as the b-tree says. Runs in the calling thread.

    Raises:
      cp.errors.IntegrityError: a shard's trailer or CRC-32C is wrong (naming the leaf).
    """
    values = [s.value for s in smalls]
    kinds = [type(v) is ValueLocation for v in values]
    located = sorted(itertools.compress(range(len(values)), kinds), key=values.__getitem__)
    order = located + [i for i, k in enumerate(kinds) if not k]  # Files by offset, then inline.
    lengths = np.fromiter(map(_SIZE, [smalls[i] for i in order]), np.int64, len(order))
    ends = np.cumsum(-(-lengths // ALIGNMENT) * ALIGNMENT)
    places = np.empty_like(ends)
    places[0], places[1:] = 0, ends[:-1]
    buffer = aligned_empty(int(ends[-1]))
    # NumPy's stubs give ndarray a __buffer__ only on Python 3.12+ (mypy checks 3.11).
    view, at = memoryview(buffer), places.tolist()  # type: ignore[arg-type]
    if not _read_values(files, [values[i] for i in located], view, at[: len(located)]):
        return None
    for i, place in zip(order[len(located) :], at[len(located) :], strict=True):
        view[place : place + len(values[i])] = cast(bytes, values[i])  # Inline: bytes.
    arrays: list[Any] = [None] * len(smalls)
    for i, place in zip(order, at, strict=True):
        stored = smalls[i].read.stored
        assert stored is not None
        arrays[i] = np.ndarray(stored.shape, stored.dtype, buffer, place)
    _check(smalls, order, buffer, places, lengths - _TRAILER, verify)
    return arrays


def _read_values(
    files: OpenFiles, locations: list[Any], buffer: memoryview, places: list[int]
) -> bool:
    """Reads each location (sorted) into ``buffer`` at its place; ``False`` if a file is
    missing or short."""
    call: list[memoryview] = []
    start = end = 0  # The file range of the call being built.
    fd = size = -1
    file = None
    try:
        for location, place in zip(locations, places, strict=True):
            if location.file != file:
                if call:
                    read_into(fd, call, start)
                    call = []
                file = location.file
                fd = files.fd(file)
                size = os.fstat(fd).st_size
            offset, length = location.offset, location.length
            if offset + length > size:
                return False  # Cut short: never read what the file cannot hold.
            gap = offset - end
            if call and not (0 <= gap <= _GAP_BYTES and len(call) < 2 * _VALUES_PER_CALL):
                read_into(fd, call, start)
                call = []
            if not call:
                start = offset
            elif gap:
                call.append(_SCRATCH[:gap])
            call.append(buffer[place : place + length])
            end = offset + length
        if call:
            read_into(fd, call, start)
    except (OSError, EOFError):  # Missing, unreadable, or changed under us.
        return False
    return True


def _check(
    smalls: Sequence[Small],
    order: list[int],
    buffer: np.ndarray,
    places: np.ndarray,
    nbytes: np.ndarray,
    verify: bool,
) -> None:
    """Raises for the first array (in ``smalls``' order) whose shard is not as written."""
    trailers = buffer[(places + nbytes)[:, None] + np.arange(_TRAILER)]
    # A shard index: offset 0 and size nbytes + 4 (little-endian uint64s), then its CRC-32C.
    index = np.ascontiguousarray(trailers[:, 4:20]).view("<u8")
    index_sums = np.ascontiguousarray(trailers[:, 20:]).view("<u4").ravel()
    sizes, which = np.unique(nbytes, return_inverse=True)
    expected_sums = np.fromiter(map(_index_checksum, sizes.tolist()), np.int64, len(sizes))
    bad = np.zeros(len(smalls), bool)
    bad[order] = (
        (index[:, 0] != 0) | (index[:, 1] != nbytes + 4) | (index_sums != expected_sums[which])
    )
    if verify:
        recorded = np.ascontiguousarray(trailers[:, :4]).view("<u4").ravel()
        # Over memoryviews: crc32c takes an ndarray's buffer three times as slowly.
        # NumPy's stubs give ndarray a __buffer__ only on Python 3.12+ (mypy checks 3.11).
        view = memoryview(buffer)  # type: ignore[arg-type]
        data = [view[p : p + n] for p, n in zip(places.tolist(), nbytes.tolist(), strict=True)]
        sums = np.fromiter(map(crc32c.crc32c, data), np.int64, len(data))
        wrong = np.zeros(len(smalls), bool)
        wrong[order] = sums != recorded
        bad |= wrong
    if not bad.any():
        return
    first = smalls[int(np.argmax(bad))].read
    stored = first.stored
    assert stored is not None
    key = zarr3.chunk_key(first.name, stored.chunk_indices[0])
    position = order.index(int(np.argmax(bad)))
    data_end = int(places[position] + nbytes[position])
    trailer = bytes(buffer[data_end + 4 : data_end + _TRAILER])
    if trailer != zarr3.shard_trailer(stored.chunk_nbytes):
        raise layout_error(first, key)
    raise checksum_error(first)


@functools.lru_cache(maxsize=1 << 16)  # Loads of one structure ask for the same sizes.
def _index_checksum(nbytes: int) -> int:
    return int.from_bytes(zarr3.shard_trailer(nbytes)[-4:], "little")


def layout_error(
    read: ArrayRead, key: str, problem: str = "does not have the layout that was written"
) -> Exception:
    """The error for a shard that is missing or not laid out as this library writes them."""
    return storage.integrity_error(read.what, f"chunk {key} {problem}")


def checksum_error(read: ArrayRead) -> Exception:
    """The error for a shard whose data does not match its CRC-32C."""
    return storage.integrity_error(read.what, "a chunk's CRC-32C does not match its data")
