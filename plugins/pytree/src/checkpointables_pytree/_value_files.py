"""Reading large values of a local OCDBT database straight into their arrays.

TensorStore's kvstore hands a value to Python as a fresh ``bytes`` object,
which a 1 GiB load then copies again into the array: on this machine that
path reads at about 0.7 GB/s, while a plain ``preadv`` into the destination
reads from the page cache at over 6 GB/s. So, for a database on the local
filesystem, TensorStore still says where each value is (``ts.ocdbt.dump``
decodes its manifest and b-tree nodes: this module never parses OCDBT's
binary format) and the bytes are then read with ``os.preadv`` straight into
the memory of the array being loaded and checked against the checksum
recorded at save time (``_checksums``).

Only values that are stored out of line in a data file have a location;
anything else (inline values, remote databases, locations that point
outside the database) is left to TensorStore's reads by the caller.
"""

from __future__ import annotations

import asyncio
import bisect
import os
from collections.abc import Collection, Sequence
from typing import Any

import attrs
import tensorstore as ts
from etils import epath

from checkpointables_pytree import _checksums

__all__ = ["ValueLocation", "find", "is_local", "locate", "read_checked", "read_into"]

# Bytes read and checksummed per step. A CRC-32 pass should find them in the CPU
# cache; the sums stream from memory nearly as fast, and each step costs the
# reading thread the GIL twice.
CRC32_BLOCK_BYTES = 1 << 20
SUMS_BLOCK_BYTES = 16 << 20


@attrs.frozen
class ValueLocation:
    """Where a value's bytes are: ``length`` bytes at ``offset`` in ``file``."""

    file: str
    offset: int
    length: int


def is_local(directory: epath.PathLike) -> bool:
    """Whether ``directory`` is on the local filesystem (not ``gs://``, ``s3://``, ...)."""
    return "://" not in os.fspath(directory)


def parse_location(text: str, directory: str) -> ValueLocation | None:
    """The location named by a dump's ``"value:<base>:<relative>:<offset>:<length>"``.

    ``None`` when the text does not have that form or names a file outside
    ``directory`` (a damaged or hostile b-tree: TensorStore's own read then
    reports it).
    """
    try:
        kind, rest = text.split(":", 1)
        rest, offset, length = rest.rsplit(":", 2)
        base_path, relative_path = rest.split(":", 1)
        location = ValueLocation(
            os.path.join(directory, base_path, relative_path), int(offset), int(length)
        )
    except ValueError:
        return None
    if kind != "value" or location.offset < 0 or location.length < 0:
        return None
    inside = os.path.normpath(location.file)
    if os.path.commonpath([inside, os.path.normpath(directory)]) != os.path.normpath(directory):
        return None
    return location


async def find(
    directory: epath.PathLike, keys: Collection[str]
) -> dict[bytes, bytes | ValueLocation]:
    """The values of ``keys`` stored inline, and the locations of the others.

    From the latest version of the database. Keys that are missing, or whose
    location cannot be used, are absent from the result. Only the b-tree nodes
    whose key ranges hold one of ``keys`` are read.
    """
    root = os.fspath(directory)
    base = await ts.KvStore.open({"driver": "file", "path": root.rstrip("/") + "/"})
    manifest = await ts.ocdbt.dump(base)
    versions = manifest.get("versions") or []
    if not versions:
        return {}
    latest = max(versions, key=lambda v: v["generation_number"])
    location = latest.get("root", {}).get("location")
    if location is None:  # An empty database.
        return {}
    wanted = sorted({k.encode() for k in keys})
    found: dict[bytes, bytes | ValueLocation] = {}
    await _walk(base, _LocationParser(root), location, b"", (wanted, frozenset(wanted)), found)
    return found


async def locate(directory: epath.PathLike, keys: Collection[str]) -> dict[str, ValueLocation]:
    """Where the out-of-line values of ``keys`` are (see ``find``)."""
    found = await find(directory, keys)
    return {k.decode(): v for k, v in found.items() if isinstance(v, ValueLocation)}


class _LocationParser:
    """Parses value locations, checking each data file's path once (not once per value)."""

    def __init__(self, root: str) -> None:
        self._root = root
        self._files: dict[str, str | None] = {}

    def __call__(self, text: str) -> ValueLocation | None:
        where, _, numbers = text.rpartition(":")
        where, _, offset = where.rpartition(":")
        if where not in self._files:
            checked = parse_location(f"{where}:0:0", self._root)
            self._files[where] = None if checked is None else checked.file
        file = self._files[where]
        try:
            start, length = int(offset), int(numbers)
        except ValueError:
            return None
        if file is None or start < 0 or length < 0:
            return None
        return ValueLocation(file, start, length)


async def _walk(
    base: Any,
    parse: _LocationParser,
    location: str,
    prefix: bytes,
    wanted_keys: tuple[Sequence[bytes], frozenset[bytes]],
    found: dict[bytes, bytes | ValueLocation],
) -> None:
    # A node's keys are relative to the prefix its ancestors' entries share
    # (each interior entry's `subtree_common_prefix`).
    node = await ts.ocdbt.dump(base, location)
    entries = node["entries"]
    wanted, wanted_set = wanted_keys  # Sorted (to pick subtrees), and as a set.
    if node["height"] == 0:
        for entry in entries:
            key = prefix + entry["key"] if prefix else entry["key"]
            if key in wanted_set:
                inline = entry.get("inline_value")
                if inline is not None:
                    found[key] = inline
                elif "indirect_value" in entry:
                    parsed = parse(entry["indirect_value"])
                    if parsed is not None:
                        found[key] = parsed
        return
    children = []
    for n, entry in enumerate(entries):
        low = prefix + entry["key"]
        high = prefix + entries[n + 1]["key"] if n + 1 < len(entries) else None
        first = bisect.bisect_left(wanted, low)
        if first < len(wanted) and (high is None or wanted[first] < high):
            child_prefix = prefix + entry.get("subtree_common_prefix", b"")
            children.append(_walk(base, parse, entry["location"], child_prefix, wanted_keys, found))
    await asyncio.gather(*children)


def read_checked(
    fd: int, location: ValueLocation, destinations: Sequence[memoryview], kind: str | None
) -> tuple[int | None, bytes]:
    """Fills ``destinations`` (in order) from the start of the value; returns (checksum, the rest).

    ``fd`` is ``location.file`` open for reading. The checksum, of ``kind``
    (see ``_checksums``; ``None``: not computed), covers every byte written to
    ``destinations``; the rest is the value's bytes after them (a shard's small
    trailer), read with the last block. Raises ``EOFError`` if the file ends
    early or the value is shorter than ``destinations``.
    """
    digest = _checksums.running(kind) if kind is not None else None
    # A zlib CRC-32 runs at cache speed, not memory speed: read a block, check it while it is
    # in the cache. The sums are as fast either way: fewer, larger reads.
    block_bytes = CRC32_BLOCK_BYTES if kind == _checksums.CRC32 else SUMS_BLOCK_BYTES
    rest_bytes = location.length - sum(len(d) for d in destinations)
    if rest_bytes < 0:
        raise EOFError(f"the value holds {location.length} bytes, fewer than asked for")
    rest = bytearray(rest_bytes)
    blocks = [d[s : s + block_bytes] for d in destinations for s in range(0, len(d), block_bytes)]
    position = location.offset
    for n, block in enumerate(blocks):
        last = n == len(blocks) - 1
        read_into(fd, [block, memoryview(rest)] if last else [block], position)
        if digest is not None:
            digest.update(block)
        position += len(block)
    if not blocks:
        read_into(fd, [memoryview(rest)], position)
    return (digest.digest() if digest is not None else None), bytes(rest)


def read_into(fd: int, buffers: list[memoryview], position: int) -> None:
    """Fills ``buffers`` (in order) from ``position`` of ``fd`` on, in as few ``preadv`` calls as
    the kernel allows (at most ``os.sysconf("SC_IOV_MAX")`` buffers).

    Raises ``EOFError`` if the file ends first.
    """
    pending = [b for b in buffers if len(b)]
    while pending:
        got = os.preadv(fd, pending, position)
        if got == 0:
            missing = sum(len(b) for b in pending)
            raise EOFError(f"file ends {missing} bytes early")
        position += got
        while got:
            if got >= len(pending[0]):
                got -= len(pending.pop(0))
            else:
                pending[0] = pending[0][got:]
                got = 0
