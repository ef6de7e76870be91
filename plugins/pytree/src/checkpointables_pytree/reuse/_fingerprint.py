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

A ``jax.Array`` shard on an accelerator is fingerprinted on its own device by
one jitted function per device and tree structure (its executable is cached:
a training loop compiles it once); only the 16 bytes per shard reach the host.

Data already in host memory (NumPy arrays, shards on CPU devices, whose host
view costs no copy) is fingerprinted by XXH3's 128-bit hash (xxHash)
instead: XLA's CPU backend runs the reduction above at about 120 MB/s, XXH3
at about 10 GB/s per core here (memory speed; BLAKE3, used before, 3 GB/s,
hashlib's SHA-256 1.2 GB/s). XXH3 is not cryptographic either: in its
authors' collision tests on inputs a few bits apart it collides at the rate
of an ideal hash, and modelled as one, a false match has chance 2**-128 per
array, as for the device reduction (no adversary crafting collisions is
assumed). The kinds are told apart by a prefix, so a fingerprint is only
ever compared with one of its own kind (a record of another kind, such as
the BLAKE3 "b" and SHA-256 "s" prints of earlier versions, matches nothing:
that array is written once more). An array over ``PIECE_BYTES`` is hashed in
pieces on several threads, and its fingerprint is the hash of their hashes
(a false match then needs two pieces' or the outer hashes to collide).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import xxhash

__all__ = [
    "PIECE_BYTES",
    "fingerprint_shards",
    "fingerprint_numpy",
    "host_bytes",
    "probe",
    "PROBE_KIND",
    "fingerprint_lanes",
    "supported",
]

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


def fingerprint_lanes(arrays: Sequence[jax.Array]) -> list[list[int]]:
    """The four lanes of the device reduction of each array (all on one device), as ints:
    what an accelerator computes, runnable on any device (tests, benchmarks)."""
    return np.asarray(_many(list(arrays))).astype(np.int64).tolist()  # type: ignore[no-any-return]


def supported(dtype: Any) -> bool:
    """Whether arrays of ``dtype`` can be fingerprinted on their device (sub-byte and
    8-byte dtypes, typed PRNG keys cannot: they are always written)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return False
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return False
    if dtype.kind == "c":
        return dtype.itemsize == 8
    if any(bits in dtype.name for bits in ("int4", "int2", "float4")):
        return False  # Sub-byte: no bitcast to whole bytes.
    return dtype == np.bool_ or (dtype.itemsize in (1, 2, 4) and dtype.kind in "iufV")


def _hex(rows: np.ndarray) -> list[str]:
    return [row.astype("<u4").tobytes().hex() for row in rows]


def fingerprint_shards(shards: Sequence[jax.Array]) -> list[str]:
    """The fingerprint (a kind letter and 32 hex digits) of each single-device array.

    The arrays of one accelerator are fingerprinted by one call; the calls of
    all devices are dispatched before any result is waited for. Shards on CPU
    devices are hashed from their host view.
    """
    by_device: dict[Any, list[int]] = {}
    on_cpu = []
    for i, shard in enumerate(shards):
        device = next(iter(shard.devices()))
        if device.platform == "cpu":
            on_cpu.append(i)
        else:
            by_device.setdefault(device, []).append(i)
    results = [(indices, _many([shards[i] for i in indices])) for indices in by_device.values()]
    out: list[str] = [""] * len(shards)
    hashed = fingerprint_numpy([np.asarray(shards[i]) for i in on_cpu])
    for i, text in zip(on_cpu, hashed, strict=True):
        out[i] = text
    for indices, rows in results:
        for i, text in zip(indices, _hex(np.asarray(rows)), strict=True):
            out[i] = "m" + text
    return out


# An array larger than this is hashed in pieces of this size, on several threads at once;
# its fingerprint is then the hash of its pieces' hashes.
PIECE_BYTES = 64 << 20


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    # xxhash releases the GIL while it hashes: one piece per core (a few at most).
    workers = min(4, os.cpu_count() or 1)
    return concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="cp-fingerprint")


def host_bytes(array: np.ndarray) -> np.ndarray:
    """The raw bytes of a host array, as a 1-D ``uint8`` array (a view if it is contiguous)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def fingerprint_numpy(arrays: Sequence[np.ndarray], piece_bytes: int = PIECE_BYTES) -> list[str]:
    """The fingerprint of each host array's raw bytes: XXH3's 128-bit hash of them, or of
    the hashes of their pieces of ``piece_bytes`` for a larger array (saves use
    ``PIECE_BYTES``: a record compares only with prints of the same piece size)."""
    raws = [host_bytes(a) for a in arrays]
    starts = [range(0, max(raw.size, 1), piece_bytes) for raw in raws]
    pieces = [raw[s : s + piece_bytes] for raw, at in zip(raws, starts, strict=True) for s in at]
    hashed = iter(
        _pool().map(xxhash.xxh3_128_digest, pieces)
        if len(pieces) > 1
        # NumPy's stubs give ndarray a __buffer__ only on Python 3.12+ (mypy checks 3.11).
        else map(xxhash.xxh3_128_digest, pieces)  # type: ignore[arg-type]
    )
    out = []
    for at in starts:
        digests = [next(hashed) for _ in at]
        whole = digests[0] if len(digests) == 1 else xxhash.xxh3_128_digest(b"".join(digests))
        out.append("x" + whole.hex())
    return out


# A probe reads this many windows of this many bytes, spread evenly over the data (the
# kind's letter names the spacing: a record's probes compare only with probes of its kind).
_PROBE_WINDOWS = 16
_PROBE_WINDOW = 256
PROBE_KIND = f"s{_PROBE_WINDOWS}x{_PROBE_WINDOW}:"


def probe(raw: np.ndarray) -> str:
    """A cheap hash of a few small windows of ``raw`` (``host_bytes``), spread over it:
    15 at even steps from its start, and its last bytes.

    Two probes that differ prove that the data differ (the hash is a function of
    the bytes read), so an array whose probes differ from those recorded for it
    has changed, and a save writes it without computing its fingerprint
    (``reuse._plan``). Equal probes prove nothing: the fingerprints, or the
    bytes themselves, decide. A training step changes every element of the
    arrays it updates, which 16 windows of 256 bytes see at once.

    >>> probe(np.zeros(1 << 20, np.uint8)) == probe(np.zeros(1 << 20, np.uint8))
    True
    """
    size = raw.size
    width = min(_PROBE_WINDOW, size)
    step = (size - width) // (_PROBE_WINDOWS - 1)
    # One copy of the spaced windows (a strided view inside ``raw``), hashed at once.
    spaced = np.lib.stride_tricks.as_strided(
        raw, (_PROBE_WINDOWS - 1, width), (step, 1), writeable=False
    )
    hasher = xxhash.xxh3_64(np.ascontiguousarray(spaced).data)
    hasher.update(raw[size - width :].data)
    return PROBE_KIND + hasher.hexdigest()
