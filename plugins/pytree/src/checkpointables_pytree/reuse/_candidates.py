"""The arrays of a save worth linking, with the layout a source's record must match.

A candidate is an array of at least ``MIN_BYTES`` that this process writes:
its shards (start, chunk key, data) and its *signature* (kind, shape, dtype,
chunk shape, storage options), compared exactly with the source's record.
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
    """One array this process may link: its shards (start, chunk key, data)."""

    name: str
    signature: str
    shards: list[tuple[list[int], str, Any]]
    on_device: bool
    nbytes: int  # Of the shards this process writes.
    array: Any = None  # The jax.Array itself (immutable: ``_known``); None for NumPy.


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


def _whole(name: str, signature: str, data: Any, on_device: bool, nbytes: int) -> Candidate:
    """An array written as one chunk (at the origin): one shard, the array itself."""
    origin = (0,) * len(data.shape)
    shard = (list(origin), zarr3.chunk_key(name, origin), data)
    return Candidate(name, signature, [shard], on_device, nbytes, data if on_device else None)


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
    name: str, array: jax.Array, nbytes: int, signatures: _Signatures, single_process: bool
) -> Candidate | None:
    if array.is_deleted():
        return None
    if not single_process and array.is_fully_addressable:
        return None  # A value every process holds: who writes it is decided later.
    shape = array.shape
    if type(array.sharding) is jax.sharding.SingleDeviceSharding:
        # One shard, the whole array: its own chunk, at the origin.
        return _whole(name, signatures("jax", shape, array.dtype, shape), array, True, nbytes)
    chunk_shape = io.chunk_shape_of(array)
    shards = []
    written = 0
    for shard in array.addressable_shards:
        if shard.replica_id != 0:
            continue
        starts = [s.indices(d)[0] for s, d in zip(shard.index, shape, strict=True)]
        index = [b // c if c else 0 for b, c in zip(starts, chunk_shape, strict=True)]
        shards.append((starts, zarr3.chunk_key(name, index), shard.data))
        written += _jax_nbytes(shard.data)
    if not shards:
        return None  # Another process writes every part of it.
    signature = signatures("jax", shape, array.dtype, chunk_shape)
    return Candidate(name, signature, shards, True, written, array)


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
    if context.memory_options.host_bytes is not None:
        # A budget cuts shards into chunks of a piece of it: a layout this module does not
        # predict either (linking by the unbudgeted one committed unloadable steps).
        cp.reuse.log_once(
            "budget",
            "Incremental saves do not reuse arrays under a host-memory budget "
            "(MemoryOptions(host_bytes=...)) yet; writing every array.",
        )
        return []
    found = []
    single = cp.multihost.process_count() == 1
    signatures = _Signatures(context)
    names = flat.structure.storage_names
    for name, value in zip(names, flat.values, strict=True):
        kind = type(value)
        if kind is np.ndarray:
            if value.nbytes < MIN_BYTES or not single or value.dtype.kind not in "biufc":
                continue
            signature = signatures("numpy", value.shape, value.dtype, value.shape)
            found.append(_whole(name, signature, value, False, value.nbytes))
        elif isinstance(value, jax.Array) and (nbytes := _jax_nbytes(value)) >= MIN_BYTES:
            if not _supported(value.dtype):
                _say_unsupported(name, value.dtype)
                continue
            candidate = _jax_candidate(name, value, nbytes, signatures, single)
            if candidate is not None:
                found.append(candidate)
    return found
