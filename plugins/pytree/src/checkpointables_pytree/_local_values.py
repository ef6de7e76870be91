"""Reading the values of many small keys of a local OCDBT database at once.

Reading 5,000 small shards through TensorStore's kvstore costs a future, a
thread hand-over and a fresh ``bytes`` object each (about 90 ms here). For a
database on the local filesystem the b-tree says where every value is:
``ts.ocdbt.dump`` decodes it (this module never parses OCDBT's binary
format), small values come inline with their keys, and the others are read
here with one ``pread`` per data file (or per value, when the values wanted
are a small part of their file). That takes about a fifth of the time.

Anything unusual (a key the walk does not find, a location outside the
database, a node that fails to decode) is left to TensorStore's reads: the
caller reads those keys the ordinary way, so damage is reported as before.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Sequence
from typing import Any

from etils import epath

from checkpointables_pytree import _value_files
from checkpointables_pytree._buffers import Slab, aligned_size

__all__ = ["read_local_values"]

# A data file's span is read at once when the wanted values fill at least this share of it.
_DENSE = 0.5


async def read_local_values(
    directory: epath.PathLike | _value_files.DatabaseIndex, keys: Sequence[str]
) -> list[bytes | bytearray | memoryview | None]:
    """The values of ``keys`` (in order) in the latest version of the local database
    in ``directory`` (or of an index of it, whose nodes are then read once for all calls).

    ``None`` for each key whose value this module cannot vouch for (missing,
    or stored somewhere unexpected): read those through TensorStore.
    """
    encoded = [key.encode() for key in keys]
    found: dict[bytes, Any] = await _value_files.index_of(directory).find(encoded)
    by_file: dict[str, list[tuple[bytes, _value_files.ValueLocation]]] = collections.defaultdict(
        list
    )
    location = _value_files.ValueLocation
    for key, value in found.items():
        if type(value) is location:
            by_file[value.file].append((key, value))
    # Reads from the page cache: a hand-over to a thread would cost more than it saves.
    read = _read_files(by_file)
    for located in by_file.values():
        for key, _ in located:
            found[key] = read.get(key)  # None: left to TensorStore.
    return list(map(found.get, encoded))


def _pread(fd: int, length: int, offset: int) -> bytearray:
    """Up to ``length`` bytes at ``offset`` (fewer only at the end of the file)."""
    buffer = bytearray(length)
    view = memoryview(buffer)
    done = 0
    while done < length:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    del view
    if done < length:
        del buffer[done:]
    return buffer


_IOV_MAX = 512  # Buffers per preadv call (the system's limit is at least 1024).
# The values of one file share buffers of about this size (see ``_buffers``).
SLAB_BYTES = 8 << 20


def _slabs(located: list[tuple[bytes, _value_files.ValueLocation]]) -> list[Slab]:
    """One slab per run of about ``SLAB_BYTES`` of ``located`` (in order): the slab of each
    value, as a list parallel to ``located``."""
    slabs: list[Slab] = []
    run: list[int] = []
    used = 0
    for _, loc in located:
        size = aligned_size(loc.length)
        if run and used + size > SLAB_BYTES:
            slab = Slab(run)
            slabs.extend([slab] * len(run))
            run, used = [], 0
        run.append(loc.length)
        used += size
    if run:
        slab = Slab(run)
        slabs.extend([slab] * len(run))
    return slabs


def _scatter_read(
    fd: int,
    located: list[tuple[bytes, _value_files.ValueLocation]],
    values: dict[bytes, memoryview | bytearray],
) -> None:
    """Reads a file's values straight into aligned pieces of shared buffers, a few ``preadv``
    calls in all.

    The bytes between values go to a scratch buffer. Values that overlap (never
    written so) are read one by one.
    """
    located = sorted(located, key=lambda item: item[1].offset)
    slabs = _slabs(located)
    scratch = memoryview(bytearray(1 << 16))
    position = located[0][1].offset
    group: list[tuple[bytes, memoryview, int]] = []  # (key, buffer, offset in the file)
    iov: list[Any] = []
    start = position

    def flush() -> None:
        nonlocal iov, group, start
        if iov:
            expected = sum(map(len, iov))
            if os.preadv(fd, iov, start) == expected:
                for key, buffer, _ in group:
                    values[key] = buffer
            else:  # The file ends early: read one by one, short values stay short.
                for key, buffer, offset in group:
                    values[key] = _pread(fd, len(buffer), offset)
        iov, group = [], []

    for (key, (_, offset, length)), slab in zip(located, slabs, strict=True):
        if offset < position:  # Overlaps the previous value.
            values[key] = _pread(fd, length, offset)
            continue
        if len(iov) >= _IOV_MAX - 8 or offset - position > 4 * len(scratch):
            flush()  # A full call, or a long stretch of other values: skip to this one.
            start = position = offset
        gap = offset - position
        while gap > 0:
            piece = min(gap, len(scratch))
            iov.append(scratch[:piece])
            gap -= piece
        buffer = memoryview(slab.take(length))
        iov.append(buffer)
        group.append((key, buffer, offset))
        position = offset + length
    flush()


def _read_files(
    by_file: dict[str, list[tuple[bytes, _value_files.ValueLocation]]],
) -> dict[bytes, bytearray | memoryview]:
    """Reads the located values, one ``pread`` per file when they fill most of it.

    A value cut short by the end of its file comes back short: the caller's
    layout check then names the leaf.
    """
    values: dict[bytes, bytearray | memoryview] = {}
    for file, located in by_file.items():
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue  # Left to TensorStore's read, which reports what is wrong.
        try:
            start = min(loc.offset for _, loc in located)
            end = max(loc.offset + loc.length for _, loc in located)
            needed = sum(loc.length for _, loc in located)
            # Writable, aligned buffers: arrays made from them need no copy.
            if needed >= _DENSE * (end - start):
                _scatter_read(fd, located, values)
            else:
                for key, loc in located:
                    values[key] = _pread(fd, loc.length, loc.offset)
        except OSError:
            for key, _ in located:
                values.pop(key, None)
        finally:
            os.close(fd)
    return values
