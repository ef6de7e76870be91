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
import concurrent.futures
import functools
import os
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import tensorstore as ts
from etils import epath

from checkpointables_pytree import _checksums, _ocdbt_dump

__all__ = [
    "DatabaseIndex",
    "ValueLocation",
    "index_of",
    "is_local",
    "locate",
    "read_checked",
    "read_into",
]

# Bytes read and checksummed per step. A CRC-32 pass should find them in the CPU
# cache; the sums stream from memory nearly as fast, and each step costs the
# reading thread the GIL twice.
CRC32_BLOCK_BYTES = 1 << 20
SUMS_BLOCK_BYTES = 16 << 20


class ValueLocation(NamedTuple):
    """Where a value's bytes are: ``length`` bytes at ``offset`` in ``file``.

    A named tuple: a load of many small arrays makes thousands.
    """

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


class DatabaseIndex:
    """The b-tree of one local database, as ``ts.ocdbt.dump`` decodes it: read once per load.

    ``prefetch`` starts reading the manifest and the root node on a worker
    thread, so that TensorStore decodes them while the caller plans its reads
    (for 5,000 small arrays the root holds 10,000 entries: about 30 ms, half
    of it in TensorStore's threads). ``find`` walks from the root to the
    nodes that hold the keys asked for; every call of one index shares the
    nodes already read.

    Example::

        index = DatabaseIndex(directory)
        index.prefetch()
        found = await index.find(["params.w/c/0/0"])
    """

    def __init__(self, directory: epath.PathLike, base_spec: Any = None) -> None:
        self._root = os.fspath(directory)
        # The database's location as a kvstore spec (default: a local directory).
        self._base_spec = base_spec or {"driver": "file", "path": self._root.rstrip("/") + "/"}
        self._start: concurrent.futures.Future[tuple[Any, Any]] | None = None
        self._nodes: dict[str, Any] = {}

    @property
    def root(self) -> str:
        """The database's directory (data file locations are paths under it)."""
        return self._root

    async def base(self) -> Any:
        """The kvstore of the database's directory (opened once)."""
        self.prefetch()
        assert self._start is not None
        return (await asyncio.wrap_future(self._start))[0]

    def prefetch(self) -> None:
        """Starts reading the manifest and the root node in the background (once)."""
        if self._start is None:
            self._start = _index_pool().submit(self._read_root)

    def _read_root(self) -> tuple[Any, Any]:
        """The base kvstore and the latest root node (``None``: an empty database)."""
        base = ts.KvStore.open(self._base_spec).result()
        manifest = _ocdbt_dump.dump(base)
        versions = manifest.get("versions") or []
        if not versions:
            return base, None
        latest = max(versions, key=lambda v: v["generation_number"])
        location = latest.get("root", {}).get("location")
        if location is None:  # An empty database.
            return base, None
        return base, (location, _ocdbt_dump.dump(base, location))

    async def find(
        self, keys: Collection[str] | Collection[bytes]
    ) -> dict[bytes, bytes | ValueLocation]:
        """The values of ``keys`` stored inline, and the locations of the others.

        From the latest version of the database. Keys that are missing, or whose
        location cannot be used, are absent from the result. Only the b-tree
        nodes whose key ranges hold one of ``keys`` are read.
        """
        self.prefetch()
        assert self._start is not None
        base, root = await asyncio.wrap_future(self._start)
        if root is None:
            return {}
        location, node = root
        self._nodes.setdefault(location, node)
        wanted = sorted({k.encode() if isinstance(k, str) else k for k in keys})
        found: dict[bytes, bytes | ValueLocation] = {}
        walk = _Walk(base, _LocationParser(self._root), self._nodes, wanted, found)
        await walk.node(location, b"")
        return found


def index_of(where: epath.PathLike | DatabaseIndex) -> DatabaseIndex:
    """``where`` if it is an index, else a new index of the database in that directory."""
    return where if isinstance(where, DatabaseIndex) else DatabaseIndex(where)


@functools.cache
def _index_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpointables-index")


async def locate(
    directory: epath.PathLike | DatabaseIndex, keys: Collection[str]
) -> dict[str, ValueLocation]:
    """Where the out-of-line values of ``keys`` are (see ``DatabaseIndex.find``); ``directory``
    may be an index already in use, whose b-tree nodes are then not read again."""
    found = await index_of(directory).find(keys)
    return {k.decode(): v for k, v in found.items() if isinstance(v, ValueLocation)}


_UNCHECKED: Any = object()  # A data file not looked at yet.


class _LocationParser:
    """Parses value locations, checking each data file's path once (not once per value)."""

    def __init__(self, root: str) -> None:
        self._root = root
        self._files: dict[str, str | None] = {}

    def __call__(self, text: str) -> ValueLocation | None:
        try:
            where, offset, numbers = text.rsplit(":", 2)
            start, length = int(offset), int(numbers)
        except ValueError:
            return None
        file = self._files.get(where, _UNCHECKED)
        if file is _UNCHECKED:
            checked = parse_location(f"{where}:0:0", self._root)
            file = self._files[where] = None if checked is None else checked.file
        if file is None or start < 0 or length < 0:
            return None
        return ValueLocation(file, start, length)


class _Walk:
    """One descent from the root to the leaf nodes that hold the wanted keys."""

    def __init__(
        self,
        base: Any,
        parse: _LocationParser,
        nodes: dict[str, Any],
        wanted: list[bytes],
        found: dict[bytes, bytes | ValueLocation],
    ) -> None:
        self._base = base
        self._parse = parse
        self._nodes = nodes  # Dumps already read, by location (shared by the index's walks).
        self._wanted = wanted  # Sorted, to pick subtrees.
        self._wanted_set = frozenset(wanted)
        self._found = found

    async def node(self, location: str, prefix: bytes) -> None:
        """Walks the node at ``location``; its keys are relative to ``prefix`` (the
        ``subtree_common_prefix`` its ancestors' entries share)."""
        node = self._nodes.get(location)
        if node is None:
            node = self._nodes[location] = await _ocdbt_dump.dump_async(self._base, location)
        entries = node["entries"]
        if node["height"] == 0:
            self._leaf(entries, prefix)
            return
        wanted = self._wanted
        children = []
        for n, entry in enumerate(entries):
            low = prefix + entry["key"]
            high = prefix + entries[n + 1]["key"] if n + 1 < len(entries) else None
            first = bisect.bisect_left(wanted, low)
            if first < len(wanted) and (high is None or wanted[first] < high):
                child_prefix = prefix + entry.get("subtree_common_prefix", b"")
                children.append(self.node(entry["location"], child_prefix))
        await asyncio.gather(*children)

    def _leaf(self, entries: list[dict[str, Any]], prefix: bytes) -> None:
        wanted, found, parse = self._wanted_set, self._found, self._parse
        for entry in entries:
            key = entry["key"]
            if prefix:
                key = prefix + key
            if key not in wanted:
                continue
            inline = entry.get("inline_value")
            if inline is not None:
                found[key] = inline
                continue
            indirect = entry.get("indirect_value")
            if indirect is not None:
                parsed = parse(indirect)
                if parsed is not None:
                    found[key] = parsed


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
