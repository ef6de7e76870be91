"""How a ``jax.Array`` is saved under a host-memory budget: chunks fetched one at a time.

Each shard this process writes is cut into zarr3 chunks of at most a piece
of the budget (the chunk shape divides the shard shape, so no chunk spans two
shards); each chunk is a ``ChunkSource`` that slices the shard on its device
and copies the slice to the host only when the writer gets to it.

What a call holds until the writes end: on CPU devices the shards' buffers
(a NumPy view keeps each alive after ``delete()`` or donation: no copy); on
accelerators a synchronous save holds nothing more, an asynchronous one a copy
of each shard in device memory, made before it returns (so the caller may
delete or donate its arrays), streamed to storage in the background.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from checkpointables_pytree import io, zarr3
from checkpointables_pytree.leaves._session import SaveSession

__all__ = ["Plan", "plan", "budget_chunk_shape", "host_chunks", "streamed_host_block"]


@attrs.frozen
class Plan:
    """The chunk shape of a streamed array and the chunks this process writes.

    ``views``: every chunk is a view of a CPU device's buffer in the stored dtype
    (fetching it copies nothing: the writer may take them all at once).
    """

    chunk_shape: tuple[int, ...]
    sources: list[io.ChunkSource]
    views: bool = False


@functools.partial(jax.jit, static_argnums=2)
def _slice(data: jax.Array, starts: tuple[jax.Array, ...], sizes: tuple[int, ...]) -> jax.Array:
    """A block of ``data`` on its device (compiled once per block shape, not per offset)."""
    return jax.lax.dynamic_slice(data, starts, sizes)


def streamed_host_block(
    data: Any, starts: tuple[int, ...], sizes: tuple[int, ...], dtype: np.dtype
) -> Any:
    """The block at ``starts`` of a shard, on the host, in ``dtype``."""
    if isinstance(data, np.ndarray):  # A view of a CPU device's buffer: no copy.
        host = data[tuple(slice(s, s + n) for s, n in zip(starts, sizes, strict=True))]
    else:
        # Always through a new device buffer, even for a whole shard: ``np.asarray`` of a
        # jax.Array caches the host copy on that array for its lifetime, so fetching the
        # caller's (or the snapshot's) array itself would keep every chunk on the host until
        # the save ends (measured on an H200: 2 GiB held under a 256 MiB budget).
        host = np.asarray(_slice(data, tuple(np.int32(s) for s in starts), sizes))
    return host if host.dtype == dtype else host.astype(dtype)


def _kept(data: jax.Array, caller_waits: bool) -> Any:
    """What a chunk is fetched from: see the module's docstring."""
    if next(iter(data.devices())).platform == "cpu":
        return np.asarray(data)
    return data if caller_waits else jnp.copy(data)


def budget_chunk_shape(array: jax.Array, dtype: np.dtype, most: int) -> tuple[int, ...]:
    """The chunk shape of a (non-empty) ``jax.Array`` saved in chunks of at most ``most``
    bytes of ``dtype``: its shards' (uneven ones: the largest), cut to fit."""
    shape = tuple(int(s) for s in array.shape)
    return io.budget_chunk_shape(shape, io.chunk_shape_of(array), dtype.itemsize, most)


def host_chunks(
    data: np.ndarray, most: int
) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], np.ndarray]]]:
    """A host array's chunk shape under a budget, and its chunks (views: no copy)."""
    shape = tuple(int(s) for s in data.shape)
    chunk = io.budget_chunk_shape(shape, shape, data.dtype.itemsize, most)
    out = []
    for offsets in io.chunk_offsets(shape, chunk):
        block = tuple(slice(o, o + c) for o, c in zip(offsets, chunk, strict=True))
        out.append((tuple(o // c for o, c in zip(offsets, chunk, strict=True)), data[block]))
    return chunk, out


def plan(
    array: jax.Array, dtype: np.dtype, session: SaveSession, most: int, *, primary_lacks: bool
) -> Plan:
    """The chunks of ``array`` this process writes, each at most ``most`` bytes."""
    shape = tuple(int(s) for s in array.shape)
    if math.prod(shape) == 0:
        return Plan(zarr3.default_chunk_shape(shape), [])
    shards = io.shards_to_write(array, session.context, primary_lacks=primary_lacks)
    chunk = budget_chunk_shape(array, dtype, most)
    sources = []
    views = array.dtype == dtype
    for shard in shards:
        data = _kept(shard.data, session.caller_waits)
        views = views and isinstance(data, np.ndarray)
        starts = [(s.indices(d)[0]) for s, d in zip(shard.index, shape, strict=True)]
        extent = [int(n) for n in shard.data.shape]
        for local in io.chunk_offsets(extent, chunk):
            sizes = tuple(min(c, e - o) for c, e, o in zip(chunk, extent, local, strict=True))
            index = tuple((s + o) // c for s, o, c in zip(starts, local, chunk, strict=True))
            fetch = functools.partial(streamed_host_block, data, tuple(local), sizes, dtype)
            sources.append(io.ChunkSource(index, math.prod(sizes) * dtype.itemsize, fetch))
    return Plan(chunk, sources, views)
