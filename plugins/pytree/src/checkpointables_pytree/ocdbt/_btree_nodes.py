"""Decoding uncompressed OCDBT b-tree nodes, column by column with NumPy.

``ts.ocdbt.dump`` turns a node into a dict per entry: for the root of 5,000
small arrays (10,000 entries) about 15 ms in TensorStore and 11 ms more to
hand back the references it leaks (``_ocdbt_index``), all while holding the
GIL. A node stores its entries column by column (every key length, then every
key, every value length, ...: TensorStore's ``index.rst``, "B+tree node
format"), so an uncompressed node decodes with a few NumPy operations per
column, and only the keys need a Python loop (each shares a prefix with the
one before).

Nodes compressed with zstd (TensorStore's default, so Orbax's checkpoints and
this library's older ones) are not decoded here: ``decode`` returns ``None``
and the caller asks ``ts.ocdbt.dump``. A node that is not what its location
promises (wrong magic, length or CRC-32C, a column running past the end)
raises ``ValueError``, as TensorStore's own decoding does.
"""

from __future__ import annotations

import os
import struct
import threading
from typing import Any

import attrs
import crc32c
import numpy as np
import tensorstore as ts

from checkpointables_pytree import storage
from checkpointables_pytree.ocdbt import _format
from checkpointables_pytree.storage import ValueLocation

__all__ = [
    "MAX_ENCODED_NODE_BYTES",
    "LeafNode",
    "check_length",
    "decode",
    "decoded",
    "parse_location",
    "read",
    "split_location",
    "value_of",
]

_MAGIC = _format.BTREE_NODE_MAGIC
_HEADER = struct.Struct("<Q")  # The node's length, after the big-endian magic.
_VARINT_BYTES = 9  # 63 bits: offsets and lengths of files; longer ones are damage.
# The nodes decoded last, with their bytes (treat them as immutable): a checkpoint loaded
# again and again (an evaluation job, a benchmark) has the same b-tree. Decoding the
# 3 MB root of 5,000 small arrays takes 3 ms, comparing its bytes 0.2 ms.
_RECENT: dict[str, tuple[bytes, Any]] = {}
_RECENT_KEPT = 4
_RECENT_LOCK = threading.Lock()
# The most bytes a node's location may claim: the decoded limit this library and Orbax
# configure (``max_decoded_node_bytes``) plus zstd's worst-case growth. A node's bytes are
# read whole into memory (here or by TensorStore), so a location claiming more (a damaged
# or forged parent node, manifest or ``_btree_checksums``) is refused before the read.
MAX_ENCODED_NODE_BYTES = _format.MAX_NODE_BYTES + (_format.MAX_NODE_BYTES >> 6)


@attrs.define
class LeafNode:
    """The entries of a leaf node: ``keys`` (relative to the node's prefix), in order.

    Entry ``i`` is inline (``inline(i)`` is its value, at ``inline_at[i]`` of the
    node's ``data``) or in a data file (``files[file_ids[i]]``, at
    ``offsets[i]``); either way ``lengths[i]`` bytes long. Inline values are
    cut out of the node only when asked for: most loads want few of them.
    """

    keys: list[bytes]
    data: bytes
    inline_at: np.ndarray  # int64; -1: in a data file.
    files: list[str]
    file_ids: np.ndarray  # The columns are int64 arrays: readers pick entries in bulk.
    offsets: np.ndarray
    lengths: np.ndarray

    def inline(self, i: int) -> bytes | None:
        """The value of entry ``i`` if it is inline, else ``None``."""
        at = int(self.inline_at[i])
        return None if at < 0 else self.data[at : at + int(self.lengths[i])]


def split_location(text: str) -> tuple[str, str, int, int]:
    """``"<kind>:<base>:<relative>:<offset>:<length>"`` as (base, relative, offset, length)."""
    _, rest = text.split(":", 1)
    rest, offset, length = rest.rsplit(":", 2)
    base, relative = rest.split(":", 1)
    return base, relative, int(offset), int(length)


def _joined(directory: str, base: str, relative: str) -> str:
    """``os.path.join(directory, base, relative)`` for relative parts, without its frames
    (a reusing save's source names a file per array: 200 here)."""
    if base.startswith("/") or relative.startswith("/"):
        return os.path.join(directory, base, relative)
    file = directory
    for part in (base, relative):
        file = f"{file}{part}" if not file or file.endswith("/") else f"{file}/{part}"
    return file


def parse_location(text: str, directory: str, kind: str = "value") -> ValueLocation | None:
    """The location named by a dump's ``"<kind>:<base>:<relative>:<offset>:<length>"``.

    ``None`` when the text does not have that form (``kind``: ``value``, or
    ``btreenode`` for a node) or names a file outside ``directory`` (a
    damaged or hostile b-tree: TensorStore's own read then reports it).
    """
    try:
        base, relative, offset, length = split_location(text)
    except ValueError:
        return None
    if not text.startswith(kind + ":") or offset < 0 or length < 0:
        return None
    file = file_inside(directory, base, relative)
    return None if file is None else ValueLocation(file, offset, length)


def file_inside(directory: str, base: str, relative: str) -> str | None:
    """The path of a node's data file ``(base, relative)`` under ``directory``; ``None`` if
    it names a file outside (``..``, an absolute path)."""
    file = _joined(directory, base, relative)
    # A name with no ".." that is not absolute stays inside (a node names hundreds of
    # files, each checked here: the full check costs 25 us).
    if not directory or ".." in file or base.startswith("/") or relative.startswith("/"):
        root = os.path.normpath(directory)
        if os.path.commonpath([os.path.normpath(file), root]) != root:
            return None
    return file


def check_length(directory: str, location: str) -> None:
    """Refuses, before it is read, a node whose ``location`` claims more than
    ``MAX_ENCODED_NODE_BYTES`` (a location that does not parse is left to the read).

    Raises:
      cp.errors.IntegrityError: naming the node's file and location.
    """
    try:
        base, relative, _, length = split_location(location)
    except ValueError:
        return
    if length > MAX_ENCODED_NODE_BYTES:
        raise storage.integrity_error(
            f"{os.path.join(directory, base + relative)} (the b-tree node at {location})",
            f"its location claims {length:,} bytes, more than any b-tree node holds "
            f"({MAX_ENCODED_NODE_BYTES:,}): the b-tree is damaged or forged",
        )


def read(base: ts.KvStore, location: str) -> Any:
    """Reads the bytes of the node at ``location`` (a future)."""
    path, relative, offset, length = split_location(location)
    return base.read(path + relative, byte_range=slice(offset, offset + length))


def value_of(result: Any) -> bytes:
    """The bytes of what ``read`` gave (``b""``: missing). Each ``result.value`` is a fresh
    copy: 3.5 ms for the 3 MB root node of 5,000 small arrays."""
    return result.value if result.state == "value" else b""


def decoded(data: bytes, location: str) -> Any:
    """The node at ``location``, read as ``data``, as ``ts.ocdbt.dump`` gives it (``None``:
    compressed, for dump to decode).

    Raises ``ValueError`` if it is missing or damaged, as dump does.
    """
    base, _, _, length = split_location(location)
    if len(data) != length:
        raise ValueError(f"the b-tree node at {location} is missing or cut short")
    recent = _RECENT.get(location)
    if recent is not None and recent[0] == data:  # The same bytes: the same node.
        return recent[1]
    decoded_node = _decode(data, base)
    result: Any = None
    if decoded_node is not None:
        result = {"height": decoded_node[0], "entries": decoded_node[1]}
    with _RECENT_LOCK:  # Loads may run in several threads.
        if len(_RECENT) >= _RECENT_KEPT:
            del _RECENT[next(iter(_RECENT))]
        _RECENT[location] = (data, result)
    return result


def decode(data: bytes, transitive: str) -> LeafNode | list[dict[str, Any]] | None:
    """The node encoded in ``data``: a ``LeafNode``, or an interior node's entries as
    ``ts.ocdbt.dump`` gives them; ``None`` if it is compressed.

    ``transitive`` is the base path of the location the node was read from:
    its data files' paths (relative to the database) start with it.

    Raises:
      ValueError: ``data`` is not a well-formed node.
    """
    node = _decode(data, transitive)
    return None if node is None else node[1]


def _decode(data: bytes, transitive: str) -> tuple[int, LeafNode | list[dict[str, Any]]] | None:
    """``decode``'s node with the height the node records (0: a leaf)."""
    view = memoryview(data)
    if len(view) < 18 or int.from_bytes(view[:4], "big") != _MAGIC:
        raise ValueError("not an OCDBT b-tree node")
    if _HEADER.unpack_from(view, 4)[0] != len(view):
        raise ValueError("a b-tree node's length differs from its location's")
    reader = _Reader(data, 12, len(view) - 4)
    if reader.varint() != 0:
        raise ValueError("an OCDBT b-tree node of an unknown version")
    if reader.varint() != 0:
        return None  # Compressed: TensorStore decodes it.
    if crc32c.crc32c(view[:-4]) != int.from_bytes(view[-4:], "little"):
        raise ValueError("a b-tree node's CRC-32C does not match its data")
    height = reader.byte()
    files = _file_table(reader, transitive)
    count = reader.varint()
    keys, prefix_lengths = _keys(reader, count, interior=height > 0)
    if height == 0:
        node: Any = _leaf(reader, keys, files)
    else:
        node = _interior(reader, keys, prefix_lengths, files)
    if reader.position != reader.end:
        raise ValueError("a b-tree node has bytes after its entries")
    return height, node


class _Reader:
    """A position in a node's bytes, and the columns read from there."""

    def __init__(self, data: bytes, position: int, end: int) -> None:
        self.data = data
        self.buffer = np.frombuffer(data, np.uint8)
        self.position = position
        self.end = end

    def byte(self) -> int:
        if self.position >= self.end:
            raise ValueError("a b-tree node ends early")
        self.position += 1
        return int(self.buffer[self.position - 1])

    def varint(self) -> int:
        return int(self.varints(1)[0])

    def varints(self, count: int) -> np.ndarray:
        """``count`` consecutive LEB128 numbers, as int64."""
        if count == 0:
            return np.zeros(0, np.int64)
        window = self.buffer[self.position : min(self.end, self.position + 9 * count)]
        single = window[:count]
        if len(single) == count and int(single.max()) < 0x80:  # Most columns: small numbers.
            self.position += count
            return single.astype(np.int64)
        ends = np.flatnonzero(window < 0x80)[:count]
        if len(ends) < count:
            raise ValueError("a b-tree node ends early")
        starts = np.zeros(count, np.int64)
        starts[1:] = ends[:-1] + 1
        sizes = ends - starts + 1
        if int(sizes.max()) > _VARINT_BYTES:
            raise ValueError("a b-tree node holds a number too large")
        values = np.zeros(count, np.int64)
        for k in range(int(sizes.max())):
            has = np.flatnonzero(sizes > k)
            values[has] |= (window[starts[has] + k].astype(np.int64) & 0x7F) << (7 * k)
        self.position += int(ends[-1]) + 1
        return values

    def bytes(self, count: int) -> bytes:
        start = self.skip(count)
        return self.data[start : start + count]

    def skip(self, count: int) -> int:
        """Moves past ``count`` bytes; returns where they start."""
        if self.position + count > self.end:
            raise ValueError("a b-tree node ends early")
        self.position += count
        return self.position - count


def _file_table(reader: _Reader, transitive: str) -> list[str]:
    """The node's data files: ``(base, relative)`` paths joined as dump writes them."""
    count = reader.varint()
    # Each path but the first shares a prefix with the one before (a node of inline
    # values only has no data file at all).
    keeps = [0, *reader.varints(count - 1).tolist()] if count else []
    sizes = reader.varints(count)
    bases = reader.varints(count).tolist()
    joined = reader.bytes(int(sizes.sum()))
    files: list[str] = []
    last, start = b"", 0
    for keep, size, base in zip(keeps, sizes.tolist(), bases, strict=True):
        last = last[:keep] + joined[start : start + size]
        start += size
        if base > len(last):
            raise ValueError("a b-tree node's data file table is malformed")
        files.append(f"{transitive}{last[:base].decode()}:{last[base:].decode()}")
    return files


def _keys(reader: _Reader, count: int, *, interior: bool) -> tuple[list[bytes], list[int]]:
    """The entries' keys (an interior node's key columns include its common prefix lengths)."""
    keeps = [0, *reader.varints(count - 1).tolist()] if count else []
    sizes = reader.varints(count)
    common = reader.varints(count).tolist() if interior else []
    joined = reader.bytes(int(sizes.sum()))
    ends = np.cumsum(sizes)
    last = b""
    # Each key is the one before's first ``keep`` bytes and its own suffix. (A damaged
    # node's keys come out wrong, not as an error: its CRC-32C was checked.)
    starts = (ends - sizes).tolist()
    keys = [
        (last := last[:keep] + joined[start:end])
        for keep, start, end in zip(keeps, starts, ends.tolist(), strict=True)
    ]
    return keys, common


def _leaf(reader: _Reader, keys: list[bytes], files: list[str]) -> LeafNode:
    count = len(keys)
    lengths = reader.varints(count)
    kinds = reader.varints(count)
    if count and int(kinds.max()) > 1:
        raise ValueError("a b-tree node holds a value of an unknown kind")
    indirect = np.flatnonzero(kinds == 1)
    file_ids = reader.varints(len(indirect))
    if len(indirect) and int(file_ids.max()) >= len(files):
        raise ValueError("a b-tree node names a data file it does not list")
    offsets = reader.varints(len(indirect))
    direct = np.flatnonzero(kinds == 0)
    inline_at = np.full(count, -1, np.int64)
    if len(direct):
        sizes = lengths[direct]
        inline_at[direct] = reader.skip(int(sizes.sum())) + np.cumsum(sizes) - sizes
    all_ids, all_offsets = np.zeros(count, np.int64), np.zeros(count, np.int64)
    all_ids[indirect], all_offsets[indirect] = file_ids, offsets
    return LeafNode(keys, reader.data, inline_at, files, all_ids, all_offsets, lengths)


def _interior(
    reader: _Reader, keys: list[bytes], common: list[int], files: list[str]
) -> list[dict[str, Any]]:
    count = len(keys)
    file_ids = reader.varints(count).tolist()
    offsets = reader.varints(count).tolist()
    lengths = reader.varints(count).tolist()
    for _ in range(3):  # Statistics: keys, tree bytes and value bytes below each child.
        reader.varints(count)
    entries = []
    columns = zip(keys, common, file_ids, offsets, lengths, strict=True)
    for key, prefix, file, offset, length in columns:
        if file >= len(files) or prefix > len(key):
            raise ValueError("a b-tree node's entry is malformed")
        entries.append(
            {
                "key": key,
                "subtree_common_prefix": key[:prefix],
                "location": f"btreenode:{files[file]}:{offset}:{length}",
            }
        )
    return entries
