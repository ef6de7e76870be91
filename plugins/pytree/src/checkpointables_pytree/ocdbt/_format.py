"""OCDBT's binary format, encoded: b-tree nodes, data file tables, the manifest.

As TensorStore's documentation specifies it ("ocdbt Key-Value Store driver",
"Storage format"), for what ``_direct_database`` writes: uncompressed nodes,
data file paths relative to the database, a manifest of the single-file kind
holding one version. Integers are unsigned LEB128 varints, stored column by
column (every key's prefix length, then every suffix length...), which is
what lets NumPy encode a node of 10,000 keys at once. Nodes are returned as
lists of parts, not joined: a node of 10,000 small values is megabytes.
"""

from __future__ import annotations

import secrets
import struct
import time
from collections.abc import Sequence
from typing import Any

import crc32c
import numpy as np

from checkpointables_pytree.ocdbt import _context

__all__ = [
    "MAX_INLINE_VALUE_BYTES",
    "BTREE_NODE_MAGIC",
    "MAX_NODE_BYTES",
    "file_table",
    "framed",
    "framed_size",
    "interior_body",
    "leaf_body",
    "leaf_ranges",
    "manifest",
    "size",
]

MAX_INLINE_VALUE_BYTES: int = _context.OCDBT_CONFIG["max_inline_value_bytes"]
MAX_NODE_BYTES: int = _context.OCDBT_CONFIG["max_decoded_node_bytes"]
_MANIFEST_MAGIC = 0x0CDB3A2A
BTREE_NODE_MAGIC = 0x0CDB20DE
_VERSION_TREE_ARITY_LOG2 = 4  # TensorStore's default.
# Bytes a leaf entry takes besides its key and inline value (at most: varints).
_ENTRY_OVERHEAD = 32


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _varints(values: Sequence[int] | np.ndarray) -> bytes:
    """Unsigned LEB128 of every value, concatenated (NumPy: one pass per byte of the longest)."""
    if not len(values):
        return b""
    v = np.asarray(values, dtype=np.uint64)
    if int(v.max()) < 0x80:
        return v.astype(np.uint8).tobytes()
    sizes = np.ones(v.size, np.int64)
    rest = v >> np.uint64(7)
    while rest.any():
        sizes += rest > 0
        rest >>= np.uint64(7)
    ends = np.cumsum(sizes)
    out = np.empty(int(ends[-1]), np.uint8)
    for k in range(int(sizes.max())):
        has = sizes > k
        group = ((v[has] >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
        out[(ends - sizes)[has] + k] = group | ((sizes[has] > k + 1).astype(np.uint8) << 7)
    return out.tobytes()


def _common_prefixes(keys: Sequence[bytes]) -> np.ndarray:
    """Length of the common prefix of each key and the next (sorted keys, NumPy over bytes)."""
    if len(keys) < 2:
        return np.zeros(0, np.int64)
    lengths = np.fromiter(map(len, keys), np.int64, len(keys))
    width = max(1, int(lengths.max()))
    table = np.array(keys, dtype=f"S{width}").view(np.uint8).reshape(len(keys), width)
    differ = table[1:] != table[:-1]
    first = np.where(differ.any(axis=1), differ.argmax(axis=1), width)
    return np.minimum(first, np.minimum(lengths[1:], lengths[:-1]))


def _prefix_coded(keys: Sequence[bytes]) -> tuple[bytes, bytes, bytes]:
    """The prefix lengths, suffix lengths and suffixes of sorted, distinct ``keys``."""
    prefixes = _common_prefixes(keys)
    lengths = np.fromiter(map(len, keys), np.int64, len(keys))
    if len(keys) > 1 and bool((prefixes == lengths[1:]).any()):
        raise ValueError("An OCDBT database cannot hold a key twice.")
    cut = [0, *prefixes.tolist()]
    suffixes = b"".join([key[n:] for key, n in zip(keys, cut, strict=True)])
    return _varints(prefixes), _varints(lengths - np.asarray(cut)), suffixes


def framed(magic: int, body: list[Any]) -> list[Any]:
    """The parts of ``body`` behind the header (magic, length, version 0, uncompressed), then
    their CRC-32C (parts, not one copy: a node of 10,000 keys is megabytes). Parts are bytes
    or 1-D uint8 arrays."""
    header = struct.pack(">I", magic) + struct.pack("<Q", framed_size(size(body))) + b"\x00\x00"
    checksum = crc32c.crc32c(header)
    for part in body:
        checksum = crc32c.crc32c(part, checksum)
    return [header, *body, struct.pack("<I", checksum)]


def framed_size(body_bytes: int) -> int:
    """Bytes of a node (or manifest) whose body is ``body_bytes`` long."""
    return 4 + 8 + 2 + body_bytes + 4


def size(parts: Sequence[bytes]) -> int:
    """Bytes of an encoded node (its parts)."""
    return sum(map(len, parts))


def file_table(paths: Sequence[bytes]) -> bytes:
    """A data file table of ``paths`` (relative to the database: base paths are empty)."""
    prefixes, suffix_lengths, suffixes = _prefix_coded(paths)
    return b"".join((_varint(len(paths)), prefixes, suffix_lengths, bytes(len(paths)), suffixes))


def leaf_ranges(
    keys: Sequence[bytes], inline_bytes: np.ndarray, limit: int
) -> list[tuple[int, int]]:
    """Splits sorted keys (whose inline values take ``inline_bytes``) into runs whose leaf
    nodes stay within ``limit`` bytes."""
    if sum(map(len, keys)) + len(keys) * (_ENTRY_OVERHEAD + MAX_INLINE_VALUE_BYTES) <= limit:
        return [(0, len(keys))]  # One node, whatever the values.
    sizes = np.fromiter(map(len, keys), np.int64, len(keys)) + _ENTRY_OVERHEAD + inline_bytes
    ranges, begin, used = [], 0, 0
    for i, entry in enumerate(sizes.tolist()):
        if i > begin and used + entry > limit:
            ranges.append((begin, i))
            begin, used = i, 0
        used += entry
    return [*ranges, (begin, len(keys))]


def leaf_body(
    keys: Sequence[bytes], lengths: Sequence[int], places: Sequence[tuple[int, int] | Any]
) -> list[Any]:
    """What follows the data file table in a b-tree leaf of sorted ``keys``, whose values are
    ``lengths`` long: in a data file ``(file, offset)``, or inline (any other place: the
    value, or what stands for it, ends the body in the keys' order)."""
    prefixes, suffix_lengths, suffixes = _prefix_coded(keys)
    kinds = [type(p) is tuple for p in places]  # 0: inline, 1: in a data file.
    indirect = [p for p, kind in zip(places, kinds, strict=True) if kind]
    return [
        _varint(len(keys)),
        prefixes,
        suffix_lengths,
        suffixes,
        _varints(lengths),
        bytes(kinds),
        _varints([file for file, _ in indirect]),
        _varints([offset for _, offset in indirect]),
        *[p for p, kind in zip(places, kinds, strict=True) if not kind],
    ]


def interior_body(
    first_keys: Sequence[bytes],
    sizes: Sequence[int],
    key_counts: Sequence[int],
    indirect_bytes: Sequence[int],
    place: tuple[int, int],
) -> bytes:
    """What follows the data file table in the root over leaves of ``sizes`` bytes (stored
    one after the other from ``place``: file, offset), which start with ``first_keys``, hold
    ``key_counts`` keys and refer to ``indirect_bytes`` of values in data files."""
    prefixes, suffix_lengths, suffixes = _prefix_coded(first_keys)
    file_id, offset = place
    offsets = np.cumsum([offset, *sizes[:-1]]).tolist()
    return b"".join(
        [
            _varint(len(first_keys)),
            prefixes,
            suffix_lengths,
            bytes(len(first_keys)),  # Common prefix of each subtree: none (leaves hold whole keys).
            suffixes,
            _varints([file_id] * len(first_keys)),
            _varints(offsets),
            _varints(sizes),
            _varints(key_counts),
            _varints(sizes),  # Bytes of each subtree's nodes: the leaf's own.
            _varints(indirect_bytes),
        ]
    )


def manifest(
    root_file: str, offset: int, length: int, height: int, statistics: Sequence[int]
) -> bytes:
    """A manifest of the single-file kind: configuration, then one version (generation 1)."""
    config = (
        secrets.token_bytes(16)  # The database's uuid.
        + _varint(0)  # Manifest kind: single file.
        + _varint(MAX_INLINE_VALUE_BYTES)
        + _varint(MAX_NODE_BYTES)
        + bytes([_VERSION_TREE_ARITY_LOG2])
        + _varint(0)  # Nodes are not compressed.
    )
    version = (
        _varint(1)  # One version...
        + _varint(1)  # ...of generation 1,
        + bytes([height])
        + _varint(0)  # whose root is in the table's only file,
        + _varint(offset)
        + _varint(length)
        + b"".join(map(_varint, statistics))  # keys, tree bytes, indirect value bytes,
        + struct.pack("<Q", time.time_ns())  # committed now.
    )
    no_version_nodes = _varint(0)
    body = [config, file_table([root_file.encode()]), version, no_version_nodes]
    return b"".join(framed(_MANIFEST_MAGIC, body))
