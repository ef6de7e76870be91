"""The chunks of an array saved under a host-memory budget: their shape, and which exist.

Under ``cp.options.MemoryOptions(host_bytes=...)`` each shard a process writes
is cut into zarr3 chunks of at most a piece of the budget (``piece_bytes``).
The leaf handlers write those chunks; incremental saves (``reuse``) predict
them with the same functions, so that an array is linked from an earlier step
only where that step stored exactly the chunks this save would write.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

__all__ = ["budget_chunk_shape", "chunk_offsets", "chunk_shape_within"]


def _length_at_most(n: int, most: int, whole: bool) -> int:
    """The chunk length along an axis of shard length ``n``: at most ``most`` (at least 1),
    the largest divisor of ``n``; where the shard spans the whole axis (``whole``) and that
    divisor is under half of ``most`` (``n`` prime...), ``most`` itself (the edge chunk is
    then shorter: no chunk spans two shards either way)."""
    if most >= n:
        return n
    most = max(most, 1)
    for k in range(-(-n // most), n + 1):
        if n % k == 0:
            divisor = n // k
            return most if whole and divisor * 2 < most else divisor
    return 1


def chunk_shape_within(
    shard_shape: Sequence[int], itemsize: int, most: int, whole_axes: Sequence[int] = ()
) -> tuple[int, ...]:
    """The chunk shape of a streamed array: the shard's, cut along its first axes (each
    chunk a contiguous block of the shard) until a chunk is at most ``most`` bytes (one
    element at least). Lengths divide the shard's, except along ``whole_axes`` (where one
    shard spans the array) when no divisor comes close."""
    chunk = [int(s) for s in shard_shape]
    for d in range(len(chunk)):
        unit = math.prod(chunk[d + 1 :]) * itemsize  # Bytes of one index along axis d.
        if chunk[d] * unit <= most:
            break
        chunk[d] = _length_at_most(chunk[d], most // unit, d in whole_axes) if unit <= most else 1
        if unit <= most:
            break
    return tuple(chunk)


def budget_chunk_shape(
    shape: Sequence[int], shard_shape: Sequence[int], itemsize: int, most: int
) -> tuple[int, ...]:
    """The chunk shape of a (non-empty) array of ``shape`` whose shards are ``shard_shape``
    (a host array: its own shape), saved in chunks of at most ``most`` bytes."""
    whole = [d for d, (s, n) in enumerate(zip(shard_shape, shape, strict=True)) if s == n]
    return chunk_shape_within(shard_shape, itemsize, most, whole)


def chunk_offsets(extent: Sequence[int], chunk: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """The offset of each chunk of ``chunk`` shape within a shard of ``extent``, in the order
    the chunks are written (row-major)."""
    steps = [range(0, int(e), int(c)) for e, c in zip(extent, chunk, strict=True)]
    return itertools.product(*steps)
