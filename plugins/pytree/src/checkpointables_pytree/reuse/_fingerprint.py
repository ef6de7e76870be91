"""Fingerprints of array data: 128 bits that tell whether an array changed since a save.

A fingerprint is four 32-bit lanes. Lane ``j`` of words ``w_0 .. w_{n-1}`` (the
array's bits as 32-bit words) is

    sum_i fmix32((w_i ^ S_j) * M_j + fmix32(i ^ P))   mod 2**32

where ``fmix32`` is MurmurHash3's finalizer (a bijection of 32-bit words),
``M_j`` odd and ``S_j``, ``P`` fixed constants. Each term is a bijection of its
word, so a change confined to one 32-bit word always changes every lane: it
is never missed. Other changes are missed only if all four lane sums
coincide; modelling the mixed terms as independent uniform words (the
standard model for such hashes; not a cryptographic guarantee, and no
adversary is assumed: the data are a training run's), that chance is
2**-128 per array, below the 2**-64 the issue allows. Shape, dtype and
layout are compared exactly, beside the fingerprint.

A ``jax.Array`` shard is fingerprinted on its own device by one jitted
function per device and tree structure (its executable is cached: a training
loop compiles it once); only the 16 bytes per shard reach the host. NumPy
arrays are fingerprinted on the host's CPU device from their raw bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["fingerprint_shards", "fingerprint_numpy", "supported"]

_SEEDS = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)
_MULTIPLIERS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)
_POSITION = 0x7F4A7C15


def _fmix32(h: jax.Array) -> jax.Array:
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as a 1-D array of uint32 (one word per element of up to 4 bytes)."""
    dtype = np.dtype(x.dtype)
    if dtype == np.bool_:
        return x.reshape(-1).astype(jnp.uint32)
    if dtype.kind == "c":
        parts = [jnp.real(x).reshape(-1), jnp.imag(x).reshape(-1)]
        return jnp.concatenate([_words(p) for p in parts])
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, unsigned).reshape(-1)
    return bits.astype(jnp.uint32)


def _lanes(words: jax.Array) -> jax.Array:
    position = _fmix32(jnp.arange(words.shape[0], dtype=jnp.uint32) ^ jnp.uint32(_POSITION))
    lanes = [
        jnp.sum(_fmix32((words ^ jnp.uint32(s)) * jnp.uint32(m) + position), dtype=jnp.uint32)
        for s, m in zip(_SEEDS, _MULTIPLIERS, strict=True)
    ]
    return jnp.stack(lanes)


@jax.jit
def _many(arrays: Sequence[jax.Array]) -> jax.Array:
    """The fingerprints of ``arrays`` (all on one device), as a ``(len, 4)`` uint32 array."""
    return jnp.stack([_lanes(_words(a)) for a in arrays])


@jax.jit
def _many_words(words: Sequence[jax.Array]) -> jax.Array:
    return jnp.stack([_lanes(w) for w in words])


def supported(dtype: Any) -> bool:
    """Whether arrays of ``dtype`` can be fingerprinted on their device (sub-byte and
    8-byte dtypes cannot: they are always written)."""
    dtype = np.dtype(dtype)
    if dtype.kind == "c":
        return dtype.itemsize == 8
    return dtype == np.bool_ or (dtype.itemsize in (1, 2, 4) and dtype.kind in "iufV")


def _hex(rows: np.ndarray) -> list[str]:
    return [row.astype("<u4").tobytes().hex() for row in rows]


def fingerprint_shards(shards: Sequence[jax.Array]) -> list[str]:
    """The fingerprint (32 hex digits) of each single-device array of ``shards``.

    The arrays of one device are fingerprinted by one call; the calls of all
    devices are dispatched before any result is waited for.
    """
    by_device: dict[Any, list[int]] = {}
    for i, shard in enumerate(shards):
        by_device.setdefault(next(iter(shard.devices())), []).append(i)
    results = [(indices, _many([shards[i] for i in indices])) for indices in by_device.values()]
    out: list[str] = [""] * len(shards)
    for indices, rows in results:
        for i, text in zip(indices, _hex(np.asarray(rows)), strict=True):
            out[i] = text
    return out


@functools.cache
def _cpu() -> Any:
    return jax.devices("cpu")[0]


def fingerprint_numpy(arrays: Sequence[np.ndarray]) -> list[str]:
    """The fingerprint of each NumPy array's raw bytes (zero-padded to whole words)."""
    if not arrays:
        return []
    words = []
    for array in arrays:
        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if raw.size % 4:
            raw = np.concatenate([raw, np.zeros(4 - raw.size % 4, np.uint8)])
        words.append(raw.view(np.uint32))
    on_cpu = jax.device_put(words, _cpu())
    return _hex(np.asarray(_many_words(on_cpu)))
