"""CRC-32C (Castagnoli), the checksum of zarr3's ``crc32c`` codec.

Arrays that the zarr3 driver writes get their checksums from TensorStore.
Small arrays are encoded here instead (see ``_zarr3``), many at once, so their
checksums must be computed here too, without a C extension:

* :func:`crc32c` is a table-driven reference, fine for a few KiB.
* :func:`crc32c_many` hands a whole batch to TensorStore's native ``crc32c``
  codec: the messages are bucketed by length, each left-padded with zeros to
  its bucket's length, and each bucket is written (while the next is built)
  to an in-memory zarr3 array whose inner chunks are the messages; the
  CRC-32Cs are read back a shard at a time. CRC algebra then removes the
  padding's effect: prepending zeros leaves the "raw" (zero-initialised) CRC
  unchanged, so only the initial-value term, which depends on the length
  alone, has to be corrected.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["crc32c", "crc32c_many", "crc32c_bytes"]

_POLY = 0x82F63B78  # Reflected Castagnoli polynomial.
_MASK = 0xFFFFFFFF


def _make_table() -> list[int]:
    table = []
    for byte in range(256):
        c = byte
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _make_table()
_TABLE_NP = np.array(_TABLE, dtype=np.uint32)


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """The CRC-32C of ``data`` (continuing from ``crc``); pure Python, for small inputs."""
    table = _TABLE
    crc ^= _MASK
    for byte in bytes(data):
        crc = (crc >> 8) ^ table[(crc ^ byte) & 0xFF]
    return crc ^ _MASK


def crc32c_bytes(data: bytes | bytearray | memoryview) -> bytes:
    """The CRC-32C of ``data`` as the 4 little-endian bytes zarr3 stores."""
    return crc32c(data).to_bytes(4, "little")


# -- Zero-byte operators ------------------------------------------------------
# Appending n zero bytes maps the CRC register linearly (over GF(2)). Each
# operator is stored as 4 tables of 256 entries, one per register byte, for
# n = 2**k; any n is a product of those.


def _apply(op: np.ndarray, x: np.ndarray) -> np.ndarray:
    return op[0][x & 0xFF] ^ op[1][(x >> 8) & 0xFF] ^ op[2][(x >> 16) & 0xFF] ^ op[3][x >> 24]


@functools.cache
def _zero_operators() -> tuple[np.ndarray, ...]:
    basis = (
        np.arange(256, dtype=np.uint64)[None, :] << (8 * np.arange(4, dtype=np.uint64))[:, None]
    ).astype(np.uint32)
    one_byte = (basis >> 8) ^ _TABLE_NP[basis & 0xFF]
    ops = [one_byte]
    for _ in range(1, 48):
        previous = ops[-1]
        ops.append(_apply(previous, _apply(previous, basis)))
    return tuple(ops)


def _after_zeros(register: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The registers after feeding ``counts[i]`` zero bytes to ``register[i]``."""
    x = register.astype(np.uint32, copy=True)
    n = counts.astype(np.int64, copy=True)
    ops = _zero_operators()
    k = 0
    while n.any():
        selected = (n & 1).astype(bool)
        if selected.any():
            x[selected] = _apply(ops[k], x[selected])
        n >>= 1
        k += 1
    return x


# Below this many bytes in total the pure-Python loop beats TensorStore's fixed cost.
_NATIVE_THRESHOLD = 16 * 1024
_MIN_BUCKET = 64


# Inner chunks per shard of the scratch arrays. One read returns this many CRC-32Cs
# (a read per chunk cost about as much as its checksum), and a bucket still has
# several shards, which TensorStore's threads encode in parallel (one shard per
# bucket was slower). 2,500 arrays: 16 ms against 23 ms with a read per chunk.
_SHARD_ROWS = 64
# Padded messages being encoded at once: enough to keep TensorStore's threads busy
# while the next bucket is built, few enough to bound a batch's extra memory.
_SCRATCH_BYTES = 8 << 20


def _open_scratch(count: int, length: int) -> Any:
    """Opens (a future of) an in-memory zarr3 array for ``count`` messages of ``length`` bytes.

    The messages are the inner chunks (``bytes`` then ``crc32c`` codecs) of
    shards of ``_SHARD_ROWS`` chunks; each inner chunk is stored as its bytes
    followed by its CRC-32C, and a shard's index (at its end) says where each
    one ends.
    """
    import tensorstore as ts

    rows = min(_SHARD_ROWS, count)
    return ts.open(
        {
            "driver": "zarr3",
            "kvstore": "memory://",
            "metadata": {
                "shape": [count * length],
                "data_type": "uint8",
                "chunk_grid": {
                    "name": "regular",
                    "configuration": {"chunk_shape": [rows * length]},
                },
                "codecs": [
                    {
                        "name": "sharding_indexed",
                        "configuration": {
                            "chunk_shape": [length],
                            "codecs": [{"name": "bytes"}, {"name": "crc32c"}],
                            "index_codecs": [
                                {"name": "bytes", "configuration": {"endian": "little"}}
                            ],
                            "index_location": "end",
                        },
                    }
                ],
            },
            "create": True,
            # Every chunk must be encoded, zeros included.
            "store_data_equal_to_fill_value": True,
        },
        # A context of its own: its memory store goes with the array.
        context=ts.Context({"cache_pool": {"total_bytes_limit": 0}}),
    )


def _stored_checksums(store: Any, count: int) -> np.ndarray:
    """The CRC-32Cs that the scratch array ``store`` holds for its ``count`` messages."""
    rows = min(_SHARD_ROWS, count)
    kvstore = store.kvstore
    futures = [kvstore.read(f"c/{i}") for i in range(-(-count // rows))]
    result = np.empty(count, dtype=np.uint32)
    tail = np.arange(4)
    for shard, future in enumerate(futures):
        value = np.frombuffer(future.result().value, dtype=np.uint8)
        first = shard * rows
        held = min(rows, count - first)
        # The index: (offset, size) of each of the shard's `rows` inner chunks.
        index = value[len(value) - 16 * rows :].view("<u8").reshape(rows, 2)[:held]
        ends = (index[:, 0] + index[:, 1] - 4).astype(np.intp)
        result[first : first + held] = value[ends[:, None] + tail].view("<u4").reshape(-1)
    return result


def crc32c_many(messages: Sequence[Any]) -> np.ndarray:
    """CRC-32C of each message (bytes-like or C-contiguous array), as a uint32 array."""
    return crc32c_of_bytes(
        [
            np.frombuffer(memoryview(m).cast("B"), np.uint8)
            if not isinstance(m, np.ndarray)
            else m.reshape(-1).view(np.uint8)
            for m in messages
        ]
    )


def crc32c_of_bytes(views: Sequence[np.ndarray]) -> np.ndarray:
    """:func:`crc32c_many` of messages that are already 1-D ``uint8`` arrays (not checked)."""
    lengths = np.fromiter(map(len, views), np.int64, len(views))
    result = np.zeros(len(views), dtype=np.uint32)
    if not len(views):
        return result
    if int(lengths.sum()) <= _NATIVE_THRESHOLD:
        for i, v in enumerate(views):
            result[i] = crc32c(v)
        return result
    len_list = lengths.tolist()
    # Bucket by padded length (a power of two) to bound the padding.
    buckets = np.maximum(
        _MIN_BUCKET, 1 << np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    )
    # crc(M) = crc(zeros + M) ^ Z(bucket) ^ Z(len(M)), Z(n) = register after n zeros from ~0.
    result ^= _after_zeros(np.full(len(views), _MASK, dtype=np.uint32), lengths)
    # Buckets are encoded while the next ones are built, up to _SCRATCH_BYTES of rows at
    # once (with their encoded copies, about twice that in memory).
    pending: collections.deque[tuple[np.ndarray, int, Any, Any, int]] = collections.deque()
    in_flight = 0

    def finish_oldest() -> int:
        rows, bucket, store, write, nbytes = pending.popleft()
        write.result()
        result[rows] ^= _stored_checksums(store, len(rows)) ^ _zeros_register(bucket)
        return nbytes

    for bucket in np.unique(buckets).tolist():
        rows = np.flatnonzero(buckets == bucket)
        opened = _open_scratch(len(rows), bucket)  # Opens while the rows are built.
        # Each row is zeros then the message: built by one concatenation (one C loop)
        # rather than a slice assignment per message.
        zeros = np.zeros(bucket, dtype=np.uint8)
        pieces: list[np.ndarray] = []
        for i in rows.tolist():
            pieces.append(zeros[: bucket - len_list[i]])
            pieces.append(views[i])
        matrix = np.concatenate(pieces)
        store = opened.result()
        write = store.write(matrix, can_reference_source_data_indefinitely=True)
        pending.append((rows, bucket, store, write, matrix.nbytes))
        in_flight += matrix.nbytes
        while in_flight > _SCRATCH_BYTES and len(pending) > 1:
            in_flight -= finish_oldest()
    while pending:
        finish_oldest()
    return result


@functools.lru_cache(maxsize=64)
def _zeros_register(count: int) -> int:
    """Z(count): the CRC register after ``count`` zero bytes fed from ~0 (one value per bucket)."""
    return int(_after_zeros(np.array([_MASK], dtype=np.uint32), np.array([count]))[0])
