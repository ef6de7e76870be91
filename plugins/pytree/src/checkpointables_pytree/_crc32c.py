"""CRC-32C (Castagnoli), the checksum of zarr3's ``crc32c`` codec.

Arrays that the zarr3 driver writes get their checksums from TensorStore.
Small arrays are encoded here instead (see ``_zarr3``), many at once, so their
checksums must be computed here too, without a C extension:

* :func:`crc32c` is a table-driven reference, fine for a few KiB.
* :func:`crc32c_many` hands a whole batch to TensorStore's native ``crc32c``
  codec in one write to an in-memory zarr3 array whose chunks are the
  messages, each left-padded with zeros to its bucket's length, and then
  removes the padding's effect with CRC algebra: prepending zeros leaves the
  "raw" (zero-initialised) CRC unchanged, so only the initial-value term,
  which depends on the length alone, has to be corrected.
"""

from __future__ import annotations

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


def _native_bucket(matrix: np.ndarray) -> np.ndarray:
    """CRC-32C of each row of a ``(count, length)`` uint8 matrix, computed by TensorStore."""
    import tensorstore as ts

    count, length = matrix.shape
    store = ts.open(
        {
            "driver": "zarr3",
            "kvstore": "memory://",
            "metadata": {
                "shape": [count * length],
                "data_type": "uint8",
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [length]}},
                "codecs": [{"name": "bytes"}, {"name": "crc32c"}],
            },
            "create": True,
            # Every chunk must be encoded, zeros included.
            "store_data_equal_to_fill_value": True,
        },
        context=ts.Context({"cache_pool": {"total_bytes_limit": 0}}),
    ).result()
    store.write(matrix.reshape(-1), can_reference_source_data_indefinitely=True).result()
    kvstore = store.kvstore
    futures = [kvstore.read(f"c/{i}") for i in range(count)]
    tails = bytearray()
    for future in futures:
        tails += future.result().value[-4:]
    return np.frombuffer(bytes(tails), dtype="<u4").astype(np.uint32)


def crc32c_many(messages: Sequence[Any]) -> np.ndarray:
    """CRC-32C of each message (bytes-like or C-contiguous array), as a uint32 array."""
    views = [
        memoryview(m).cast("B") if not isinstance(m, np.ndarray) else m.reshape(-1).view(np.uint8)
        for m in messages
    ]
    lengths = np.fromiter(
        (v.nbytes if isinstance(v, memoryview) else v.size for v in views), np.int64, len(views)
    )
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
    for bucket in np.unique(buckets).tolist():
        rows = np.flatnonzero(buckets == bucket)
        # Each row is zeros then the message: built by one concatenation (one C loop)
        # rather than a slice assignment per message.
        zeros = np.zeros(bucket, dtype=np.uint8)
        pieces: list[Any] = []
        for i in rows.tolist():
            view = views[i]
            pieces.append(zeros[: bucket - len_list[i]])
            pieces.append(view if isinstance(view, np.ndarray) else np.frombuffer(view, np.uint8))
        matrix = np.concatenate(pieces).reshape(len(rows), bucket)
        padded = _native_bucket(matrix)
        # crc(M) = crc(zeros + M) ^ Z(bucket) ^ Z(len(M)), Z(n) = register after n zeros from ~0.
        start = np.full(len(rows), _MASK, dtype=np.uint32)
        correction = _after_zeros(start, np.full(len(rows), bucket)) ^ _after_zeros(
            start, lengths[rows]
        )
        result[rows] = padded ^ correction
    return result
