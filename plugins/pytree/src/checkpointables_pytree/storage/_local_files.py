"""The one place that reads a local database's files without TensorStore.

TensorStore's kvstore hands each value to Python as a fresh ``bytes`` object:
5,000 small values cost a future and a thread hand-over each (about 90 ms
here), and a 1 GiB load read at about 0.7 GB/s, copying every byte once more
into its array. The b-tree says where each value is (``_ocdbt_index``), so
``read_values`` reads them with ``os.preadv`` straight into 64-byte aligned
buffers, which become the arrays (on CPU ``jax.device_put`` aliases them):
the values of one file in as few calls as the kernel allows, the bytes
between them into a scratch buffer.

Nothing here decides what a value means: callers check each value (its
CRC-32C, its shard index). A value this module cannot read is ``None``, for
the reasons named in ``read_values``; the caller then reads it through
TensorStore, which reports what is wrong with it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import NamedTuple

import checkpointables as cp

from checkpointables_pytree.storage._buffers import Slab

__all__ = ["OpenFiles", "ValueLocation", "read_into", "read_range", "read_values"]


class ValueLocation(NamedTuple):
    """Where a value's bytes are: ``length`` bytes at ``offset`` in ``file``.

    ``file`` is under the database's directory (``<root>/d/<name>``, or
    ``<root>/ocdbt.process_1/d/<name>`` after a merge). A named tuple: a load
    of many small arrays makes thousands.
    """

    file: str
    offset: int
    length: int


# The values of one call share buffers of about this size: one kept array keeps at most
# this much of its neighbours' memory alive.
SLAB_BYTES = 8 << 20
_IOV_MAX = 512  # Buffers per preadv call (the system's limit is at least 1024).
# Between two values of one file, up to this many bytes are read and dropped rather
# than starting another call.
_GAP_BYTES = 256 << 10
_SCRATCH = memoryview(bytearray(_GAP_BYTES))  # Gaps land here (threads share it: never read).


class OpenFiles:
    """The data files of one load, each opened once and shared by the reading threads."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def fd(self, path: str) -> int:
        """A descriptor of ``path`` open for reading (raises ``OSError``, or
        ``cp.errors.IntegrityError`` if it is not a regular file)."""
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                # A pipe planted in place of a data file raises (IntegrityError), never blocks.
                fd = self._fds[path] = cp.storage.open_regular_file(path)
            return fd

    def close(self) -> None:
        """Closes every descriptor; call once no read uses them any more."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def read_values(
    files: OpenFiles, locations: Sequence[ValueLocation | None]
) -> list[memoryview | None]:
    """The bytes at each location (``None`` in, ``None`` out), read through ``files``.

    Every value gets its own 64-byte aligned piece of one buffer. A value is
    ``None`` (left to TensorStore) when its file cannot be opened or is
    shorter than the location says (a damaged database, or one changed since
    its b-tree was read). Runs in the calling thread; ``preadv`` releases the GIL.
    """
    order = sorted(
        (i for i, loc in enumerate(locations) if loc is not None),
        key=lambda i: locations[i][:2],  # type: ignore[index]
    )
    slabs = Slab.runs([locations[i].length for i in order], SLAB_BYTES)  # type: ignore[union-attr]
    slab_of = dict(zip(order, slabs, strict=True))
    values: list[memoryview | None] = [None] * len(locations)
    start = 0
    while start < len(order):
        file = locations[order[start]].file  # type: ignore[union-attr]
        end = start
        while end < len(order) and locations[order[end]].file == file:  # type: ignore[union-attr]
            end += 1
        _read_file(files, file, order[start:end], locations, slab_of, values)
        start = end
    return values


def _read_file(
    files: OpenFiles,
    path: str,
    indices: list[int],
    locations: Sequence[ValueLocation | None],
    slab_of: dict[int, Slab],
    values: list[memoryview | None],
) -> None:
    """Reads the values ``indices`` (sorted by offset) of one data file into ``values``."""
    try:
        fd = files.fd(path)
        size = os.fstat(fd).st_size
    except OSError:  # Missing or unreadable: TensorStore's read reports it.
        return
    call: list[tuple[int, memoryview]] = []  # The values of one preadv call.
    for i in indices:
        offset, length = locations[i][1:]  # type: ignore[index]
        if offset + length > size:
            continue  # Cut short: never allocate what the file cannot hold.
        if call and not _joins(locations[call[-1][0]], len(call), offset):  # type: ignore[arg-type]
            _read_call(fd, call, locations, values)
            call = []
        # NumPy's stubs give ndarray a __buffer__ only on Python 3.12+ (mypy checks 3.11).
        call.append((i, memoryview(slab_of[i].take(length))))  # type: ignore[arg-type]
    if call:
        _read_call(fd, call, locations, values)


def _joins(last: ValueLocation, count: int, offset: int) -> bool:
    """Whether a value at ``offset`` can join, in one ``preadv``, ``count`` values ending
    with ``last``."""
    gap = offset - (last.offset + last.length)
    return 0 <= gap <= _GAP_BYTES and count < _IOV_MAX // 2


def _read_call(
    fd: int,
    call: list[tuple[int, memoryview]],
    locations: Sequence[ValueLocation | None],
    values: list[memoryview | None],
) -> None:
    """One ``preadv`` for the values of ``call`` (neighbours in one file, gaps dropped)."""
    first = locations[call[0][0]]
    assert first is not None
    position = first.offset
    buffers: list[memoryview] = []
    for i, buffer in call:
        location = locations[i]
        assert location is not None
        if location.offset > position:
            buffers.append(_SCRATCH[: location.offset - position])
        buffers.append(buffer)
        position = location.offset + location.length
    try:
        read_into(fd, buffers, first.offset)
    except (OSError, EOFError):  # The file changed under us: TensorStore's reads report it.
        return
    for i, buffer in call:
        values[i] = buffer


def read_range(path: str, offset: int, length: int) -> bytes | None:
    """``length`` bytes at ``offset`` of the file at ``path`` (one copy, where TensorStore's
    read makes two); ``None`` if they cannot all be read: TensorStore's read reports why."""
    try:
        fd = cp.storage.open_regular_file(path)  # Not a regular file: IntegrityError.
    except OSError:
        return None
    try:
        # A length read from a damaged or forged b-tree may be anything: it is checked
        # against the file before memory is allocated for it.
        if offset < 0 or length < 0 or offset + length > os.fstat(fd).st_size:
            return None
        data = os.pread(fd, length, offset)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) == length else None


def read_into(fd: int, buffers: list[memoryview], position: int) -> None:
    """Fills ``buffers`` (in order) from ``position`` of ``fd``; ``EOFError`` if it ends first."""
    pending = [b for b in buffers if len(b)]
    while pending:
        got = os.preadv(fd, pending, position)
        if got == 0:
            raise EOFError(f"file ends {sum(map(len, pending))} bytes early")
        position += got
        while got:
            if got >= len(pending[0]):
                got -= len(pending.pop(0))
            else:
                pending[0] = pending[0][got:]
                got = 0
