"""The arrays of a save worth linking, with the layout a source's record must match.

A candidate is an array of at least ``MIN_BYTES`` that this process writes:
its shards (start, chunk key, data) and its *signature* (kind, shape, dtype,
chunk shape, storage options), compared exactly with the source's record.
Under a host-memory budget the chunk shape is the budget's (``io.budget_chunk_shape``,
as the leaf handlers write it) and the candidate lists every chunk key of its
shards: a source that stored other chunks (another budget) is never linked.
A training loop saves the same few hundred arrays at every step, so the
per-array work is kept to a few attribute reads: a signature is made once per
distinct layout of a save (most arrays of a tree share a few), whether a dtype
can be fingerprinted is known once per dtype, and an array on one device (the
common case on one host) needs no walk over ``addressable_shards``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Sequence
from typing import Any

import attrs
import checkpointables as cp
import jax
import numpy as np

from checkpointables_pytree import io, tree, zarr3
from checkpointables_pytree.reuse import _fingerprint

__all__ = ["MIN_BYTES", "Candidate", "candidates"]

# Smaller arrays are rewritten: a few KiB cost less than their fingerprint and link.
MIN_BYTES = 64 << 10


@attrs.frozen
class Candidate:
    """One array this process may link: its shards (start, first chunk key, data)."""

    name: str
    signature: str
    shards: list[tuple[list[int], str, Any]]
    on_device: bool
    nbytes: int  # Of the shards this process writes.
    array: Any = None  # The jax.Array itself (immutable: ``_known``); None for NumPy.
    # Every chunk key of its shards, where a budget cuts them into several chunks each.
    budget_keys: list[str] | None = None
    # The bytes each of its chunks is stored in, where known (uncompressed, one inner
    # chunk): a source's chunk of another length is of another layout, never linked.
    stored_bytes: int | None = None

    @property
    def keys(self) -> list[str]:
        """The key of every chunk this process writes of it: what a link must find."""
        if self.budget_keys is not None:
            return self.budget_keys
        return [key for _, key, _ in self.shards]


@functools.lru_cache(maxsize=256)
def _supported(dtype: Any) -> bool:
    """``_fingerprint.supported``, once per dtype (a few per tree)."""
    return _fingerprint.supported(dtype)


class _Signatures:
    """The signatures of one save's arrays, each distinct layout described once.

    The text is what earlier versions recorded (``json.dumps`` of the same list), so
    that records stay comparable across versions.
    """

    def __init__(self, context: cp.Context) -> None:
        options = context.array_options
        self._options = [bool(options.use_compression), repr(options.storage_options)]
        self._made: dict[tuple[Any, ...], str] = {}
        # Chunks stored as their bytes and a fixed trailer: their length is known.
        self._plain = not options.use_compression and not options.storage_options.chunk_byte_size

    def stored_bytes(self, dtype: Any, chunk_shape: Sequence[int]) -> int | None:
        """The bytes a chunk of ``chunk_shape`` is stored in, where known."""
        if not self._plain:
            return None
        return math.prod(chunk_shape) * np.dtype(dtype).itemsize + zarr3.SHARD_TRAILER_BYTES

    def __call__(
        self, kind: str, shape: Sequence[int], dtype: Any, chunk_shape: Sequence[int]
    ) -> str:
        key = (kind, tuple(shape), dtype, tuple(chunk_shape))
        text = self._made.get(key)
        if text is None:
            layout = [kind, [int(s) for s in shape], np.dtype(dtype).str]
            text = json.dumps([*layout, [int(c) for c in chunk_shape], *self._options])
            self._made[key] = text
        return text


def _whole(
    name: str, signatures: _Signatures, kind: str, data: Any, nbytes: int, most: int | None
) -> Candidate:
    """An array written as one shard (at the origin): the array itself, in one chunk, or in
    chunks of at most ``most`` bytes under a budget."""
    shape = tuple(int(s) for s in data.shape)
    origin = (0,) * len(shape)
    shard = (list(origin), zarr3.chunk_key(name, origin), data)
    on_device = kind == "jax"
    chunk_shape, keys = shape, None
    if most is not None:
        chunk_shape = io.budget_chunk_shape(shape, shape, data.dtype.itemsize, most)
        keys = _chunk_keys(name, origin, shape, chunk_shape)
    signature = signatures(kind, shape, data.dtype, chunk_shape)
    array = data if on_device else None
    stored = signatures.stored_bytes(data.dtype, chunk_shape)
    return Candidate(name, signature, [shard], on_device, nbytes, array, keys, stored)


def _chunk_keys(
    name: str, starts: Sequence[int], extent: Sequence[int], chunk_shape: Sequence[int]
) -> list[str]:
    """The keys of the chunks of a shard at ``starts`` of ``extent`` under a budget, as
    ``io.chunk_offsets`` orders them (the leaf handlers' ``_streamed_saves``)."""
    keys = []
    for local in io.chunk_offsets(extent, chunk_shape):
        index = [(s + o) // c for s, o, c in zip(starts, local, chunk_shape, strict=True)]
        keys.append(zarr3.chunk_key(name, index))
    return keys


def _say_unsupported(name: str, dtype: Any) -> None:
    """Says once per dtype that its arrays are written at every save (declared frozen or
    not: a predicate naming them is not why)."""
    cp.reuse.log_once(
        f"dtype:{dtype}",
        f"Incremental saves do not reuse jax.Arrays of dtype {dtype} (sub-byte and 8-byte "
        f"dtypes and PRNG keys have no fingerprint on the device), such as {name!r}: they are "
        f"written at every save.",
        logging.WARNING,
    )


def _jax_nbytes(array: jax.Array) -> int:
    # ``jax.Array.nbytes`` is a Python property (np.size of the array): this is its value.
    return math.prod(array.shape) * array.dtype.itemsize


def _jax_candidate(
    name: str,
    array: jax.Array,
    nbytes: int,
    signatures: _Signatures,
    single_process: bool,
    most: int | None,
) -> Candidate | None:
    """``array`` as a candidate; ``most``: the bytes of a chunk under a budget."""
    if array.is_deleted():
        return None
    if not single_process and array.is_fully_addressable:
        return None  # A value every process holds: who writes it is decided later.
    shape = tuple(int(s) for s in array.shape)
    if type(array.sharding) is jax.sharding.SingleDeviceSharding:
        # One shard, the whole array: its own chunk (or a budget's), at the origin.
        return _whole(name, signatures, "jax", array, nbytes, most)
    chunk_shape = io.chunk_shape_of(array)
    if most is not None:  # As the leaf handler's ``_streamed_saves.budget_chunk_shape``.
        chunk_shape = io.budget_chunk_shape(shape, chunk_shape, array.dtype.itemsize, most)
    shards = []
    keys: list[str] | None = [] if most is not None else None
    written = 0
    for shard in array.addressable_shards:
        if shard.replica_id != 0:
            continue
        starts = [s.indices(d)[0] for s, d in zip(shard.index, shape, strict=True)]
        index = [b // c if c else 0 for b, c in zip(starts, chunk_shape, strict=True)]
        shards.append((starts, zarr3.chunk_key(name, index), shard.data))
        if keys is not None:
            keys += _chunk_keys(name, starts, shard.data.shape, chunk_shape)
        written += _jax_nbytes(shard.data)
    if not shards:
        return None  # Another process writes every part of it.
    signature = signatures("jax", shape, array.dtype, chunk_shape)
    stored = signatures.stored_bytes(array.dtype, chunk_shape)
    return Candidate(name, signature, shards, True, written, array, keys, stored)


def candidates(flat: tree.Flat, context: cp.Context) -> list[Candidate]:
    """The arrays worth linking that this process writes."""
    options = context.array_options
    if options.storage_options_creator is not None or options.storage_options.dtype is not None:
        cp.reuse.log_once(
            "casts",
            "Incremental saves do not reuse arrays saved with storage_options_creator or a "
            "storage dtype (ArrayStorageOptions(dtype=...)); writing every array.",
        )
        return []  # Per-leaf options or casts: layouts this module does not predict.
    # A budget cuts shards into chunks of a piece of it: the signature holds that chunk
    # shape and the candidate every chunk's key, so that only a source that stored exactly
    # these chunks is linked (another budget, another chunk shape: written).
    budget = context.memory_options.host_bytes
    most = None if budget is None else io.piece_bytes(budget)
    found = []
    single = cp.multihost.process_count() == 1
    signatures = _Signatures(context)
    names = flat.structure.storage_names
    for name, value in zip(names, flat.values, strict=True):
        kind = type(value)
        if kind is np.ndarray:
            if value.nbytes < MIN_BYTES or not single or value.dtype.kind not in "biufc":
                continue
            found.append(_whole(name, signatures, "numpy", value, value.nbytes, most))
        elif isinstance(value, jax.Array) and (nbytes := _jax_nbytes(value)) >= MIN_BYTES:
            if not _supported(value.dtype):
                _say_unsupported(name, value.dtype)
                continue
            candidate = _jax_candidate(name, value, nbytes, signatures, single, most)
            if candidate is not None:
                found.append(candidate)
    return found
