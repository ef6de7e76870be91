"""Zarr v3 arrays as Orbax stores them: metadata, chunk keys and shard encoding.

Every array is a zarr3 array whose chunks are ``sharding_indexed`` shards
(one per written shard of the source array). Inside a shard, each inner
chunk is the raw little-endian bytes followed by their CRC-32C, and the shard
index at the end carries its own CRC-32C::

    [data][crc32c(data)] ... [offset u64, nbytes u64]*n [crc32c(index)]

The batched writer produces these bytes itself for small arrays (one inner
chunk per shard) and the batched reader checks them; TensorStore's zarr3
driver reads them back, as does Orbax.
``zarr_json`` reproduces, byte for byte, the ``zarr.json`` TensorStore writes
for the same array, so both paths leave identical files. ``ZarrLayout`` is
where one array lives and how it is chunked; ``ArrayWrite`` one array to
write: its layout and the chunks this process owns.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import checkpointables as cp
import crc32c
import numpy as np

__all__ = [
    "array_prefix",
    "zarr_shape_dtype",
    "check_own_codecs",
    "contradiction_error",
    "foreign_codec",
    "record_contradiction",
    "ArrayWrite",
    "zarr_dtype_name",
    "zarr_json",
    "chunk_key",
    "encode_shard",
    "full_chunk",
    "shard_end",
    "shard_trailer",
    "SHARD_TRAILER_BYTES",
    "ZarrLayout",
]

# What a shard of one inner chunk holds after the chunk's data: its CRC-32C (4 bytes), then
# the shard index (16) and the index's CRC-32C (4).
SHARD_TRAILER_BYTES = 24

# Data types zarr3 (TensorStore) stores as fixed-size little-endian bytes. int4
# and friends are packed differently, so they always go through the driver
# (which has no uint4 or uint2: arrays of those cannot be stored).
_DIRECT_DTYPES = frozenset(
    {
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "bfloat16",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e4m3b11fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
    }
)
_DRIVER_ONLY_DTYPES = frozenset({"int4", "int2", "float4_e2m1fn"})
_LITTLE_ENDIAN = sys.byteorder == "little"


@functools.cache
def _names(dtype: np.dtype) -> tuple[str | None, bool]:
    name = dtype.name
    stored = name if name in _DIRECT_DTYPES or name in _DRIVER_ONLY_DTYPES else None
    return stored, _LITTLE_ENDIAN and name in _DIRECT_DTYPES


def zarr_dtype_name(dtype: Any) -> str | None:
    """The zarr3 ``data_type`` for a NumPy dtype, or ``None`` if zarr3 cannot store it."""
    return _names(np.dtype(dtype))[0]


def is_direct_dtype(dtype: Any) -> bool:
    """Whether arrays of ``dtype`` can be encoded here (not only by the driver)."""
    return _names(np.dtype(dtype))[1]


def _fill_value(dtype: np.dtype) -> Any:
    if dtype.kind == "b":
        return False
    # ml_dtypes' int2/int4/uint2/uint4 are kind "V": integers all the same (TensorStore
    # writes 0 for them; earlier versions here wrote 0.0, which verify still accepts).
    if dtype.kind in "iu" or dtype.name.startswith(("int", "uint")):
        return 0
    if dtype.kind == "c":
        return [0.0, 0.0]
    return 0.0


def _bytes_codec(dtype: np.dtype) -> dict[str, Any]:
    # Single-byte types have no byte order, and TensorStore records none.
    if dtype.itemsize == 1:
        return {"name": "bytes"}
    return {"configuration": {"endian": "little"}, "name": "bytes"}


def inner_codecs(dtype: Any, *, compression: bool) -> list[dict[str, Any]]:
    """The codecs of each inner chunk: raw bytes, optional zstd, then the checksum."""
    dtype = np.dtype(dtype)
    codecs: list[dict[str, Any]] = [_bytes_codec(dtype)]
    if compression:
        codecs.append({"configuration": {"checksum": False, "level": 1}, "name": "zstd"})
    codecs.append({"name": "crc32c"})
    return codecs


_INDEX_CODECS = [{"configuration": {"endian": "little"}, "name": "bytes"}, {"name": "crc32c"}]


def metadata_dict(
    shape: Sequence[int],
    dtype: Any,
    chunk_shape: Sequence[int],
    inner_chunk_shape: Sequence[int] | None = None,
    *,
    compression: bool = False,
) -> dict[str, Any]:
    """The ``metadata`` member of a TensorStore zarr3 spec (also ``zarr.json``'s content)."""
    dtype = np.dtype(dtype)
    chunk_shape = list(chunk_shape)
    inner = list(inner_chunk_shape) if inner_chunk_shape is not None else chunk_shape
    return {
        "chunk_grid": {"configuration": {"chunk_shape": chunk_shape}, "name": "regular"},
        "chunk_key_encoding": {"name": "default"},
        "codecs": [
            {
                "configuration": {
                    "chunk_shape": inner,
                    "codecs": inner_codecs(dtype, compression=compression),
                    "index_codecs": _INDEX_CODECS,
                },
                "name": "sharding_indexed",
            }
        ],
        "data_type": zarr_dtype_name(dtype),
        "fill_value": _fill_value(dtype),
        "node_type": "array",
        "shape": list(shape),
        "zarr_format": 3,
    }


@functools.lru_cache(maxsize=4096)
def _zarr_json_cached(
    shape: tuple[int, ...], dtype: np.dtype, chunk_shape: tuple[int, ...]
) -> bytes:
    text = json.dumps(
        metadata_dict(shape, dtype, chunk_shape), separators=(",", ":"), sort_keys=True
    )
    return text.encode()


def zarr_json(shape: Sequence[int], dtype: Any, chunk_shape: Sequence[int]) -> bytes:
    """The ``zarr.json`` of an uncompressed array with one inner chunk per shard."""
    return _zarr_json_cached(tuple(shape), np.dtype(dtype), tuple(chunk_shape))


def default_chunk_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """One chunk for the whole array (zarr3 needs every chunk dimension >= 1)."""
    return tuple(max(1, int(d)) for d in shape)


def array_prefix(name: str) -> str:
    """The key prefix of array ``name``'s keys: ``name/``, or ``name`` itself when it ends
    with ``/`` (TensorStore joins paths without doubling it: Orbax stores the array of a
    key ``"x/"`` at ``x/zarr.json``)."""
    return name if name.endswith("/") else name + "/"


def chunk_key(name: str, index: Sequence[int]) -> str:
    """The key of chunk ``index`` of array ``name``: ``name/c/i/j``, or ``name/c`` for 0-d."""
    if not index:
        return f"{array_prefix(name)}c"
    return f"{array_prefix(name)}c/{_index_suffix(tuple(index))}"


@functools.lru_cache(maxsize=4096)  # Most arrays have one chunk: (0,), (0, 0), ...
def _index_suffix(index: tuple[int, ...]) -> str:
    return "/".join(str(int(i)) for i in index)


def chunk_grid(shape: Sequence[int], chunk_shape: Sequence[int]) -> tuple[int, ...]:
    """How many chunks the array has along each dimension."""
    return tuple(-(-int(s) // int(c)) for s, c in zip(shape, chunk_shape, strict=True))


# The smallest chunk a split leaves, as a fraction of the target (``choose_inner_chunk_shape``).
MIN_CHUNK_FRACTION = 16


def choose_inner_chunk_shape(
    write_shape: Sequence[int], itemsize: int, target_bytes: int, shard_axes: Sequence[int] = ()
) -> tuple[int, ...]:
    """Splits ``write_shape`` into chunks of at most ``target_bytes`` that divide it evenly.

    Axes in ``shard_axes`` are split first, then the largest remaining ones;
    each split takes the next smaller divisor of that dimension. A split that would leave
    chunks of less than ``target_bytes / MIN_CHUNK_FRACTION`` (a prime or near-prime
    dimension, whose next divisor is 1) is not made: the chunks then stay larger than
    ``target_bytes``, rather than millions of chunks of a few bytes (each costing far
    more in index and memory than its data).
    """
    shape = [int(s) for s in write_shape]
    chunk = list(shape)
    ndim = len(shape)
    preferred = [a % ndim for a in shard_axes] if ndim else []

    def smaller_divisor(axis: int) -> int | None:
        below = [d for d in _divisors(shape[axis]) if d < chunk[axis]]
        return max(below) if below else None

    while math.prod(chunk) * itemsize > target_bytes:
        axes = [a for a in preferred if chunk[a] > 1] or sorted(
            (a for a in range(ndim) if chunk[a] > 1), key=lambda a: -chunk[a]
        )
        for axis in axes:
            divisor = smaller_divisor(axis)
            if divisor is None:
                continue
            split_bytes = math.prod(chunk) // chunk[axis] * divisor * itemsize
            if split_bytes * MIN_CHUNK_FRACTION >= target_bytes:
                chunk[axis] = divisor
                break
        else:
            break
    return tuple(chunk)


def _divisors(n: int) -> list[int]:
    """Every divisor of ``n`` (found up to its square root: a dimension of millions is
    factored in a thousand steps, not walked)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in small]


def inner_chunk_shape(
    chunk_shape: Sequence[int],
    itemsize: int,
    chunk_byte_size: int | None,
    shard_axes: Sequence[int] = (),
) -> tuple[int, ...] | None:
    """The inner chunk shape a save with ``ArrayStorageOptions(chunk_byte_size=...,
    shard_axes=...)`` writes each chunk (shard) of ``chunk_shape`` in; ``None``: one inner
    chunk per shard (no ``chunk_byte_size``, or a chunk within it). One definition, for
    the leaf handlers that write it and the reuse room that checks a source against it."""
    if not chunk_byte_size:
        return None
    chunk = tuple(int(c) for c in chunk_shape)
    inner = choose_inner_chunk_shape(chunk, itemsize, int(chunk_byte_size), shard_axes)
    return None if inner == chunk else inner


def all_chunk_indices(shape: Sequence[int], chunk_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Every chunk index of an array, in C order (none for a zero-size array)."""
    if tuple(shape) == tuple(chunk_shape):
        return [(0,) * len(shape)]
    grid = chunk_grid(shape, chunk_shape)
    if any(g == 0 for g in grid):
        return []
    return [tuple(int(i) for i in idx) for idx in np.ndindex(*grid)]


@functools.lru_cache(maxsize=4096)
def shard_trailer(nbytes: int) -> bytes:
    """The index of a shard with one inner chunk of ``nbytes`` data bytes, and its checksum."""
    index = (0).to_bytes(8, "little") + (nbytes + 4).to_bytes(8, "little")
    return index + crc32c.crc32c(index).to_bytes(4, "little")


def shard_end(chunk: np.ndarray) -> bytes:
    """What follows a shard's only chunk (contiguous bytes): its CRC-32C, the shard index
    and its CRC-32C."""
    # NumPy's stubs give ndarray a __buffer__ only on Python 3.12+ (mypy checks 3.11).
    return crc32c.crc32c(chunk).to_bytes(4, "little") + shard_trailer(chunk.nbytes)  # type: ignore[arg-type]


def encode_shard(data: bytes | memoryview, checksum: int) -> bytes:
    """A shard holding one inner chunk: ``data``, its checksum, then the index."""
    return b"".join((data, int(checksum).to_bytes(4, "little"), shard_trailer(len(data))))


def zarr_shape_dtype(
    document: Mapping[str, Any], where: str = "a zarr.json"
) -> tuple[tuple[int, ...], np.dtype, tuple[int, ...] | None]:
    """Shape, dtype and chunk shape from a zarr v3 ``zarr.json`` or v2 ``.zarray``.

    Raises:
      cp.errors.MetadataError: ``document`` (``where``, in messages) lacks them or is malformed.
    """
    try:
        shape = tuple(int(s) for s in document["shape"])
        if "data_type" in document:  # zarr v3
            dtype = np.dtype(document["data_type"])
            chunk = document.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape")
        else:  # zarr v2
            dtype = np.dtype(document["dtype"])
            chunk = document.get("chunks")
        chunks = tuple(int(c) for c in chunk) if chunk is not None else None
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
        chunks = shape = None  # type: ignore[assignment]
    if shape is None or min(shape, default=0) < 0 or min(chunks or (1,)) < 1 or dtype.hasobject:
        raise cp.errors.MetadataError(
            f"{where} does not describe an array (shape, data type and chunk shape): the "
            f"checkpoint is damaged. Restore it from a copy."
        )
    problem = _contradiction(document, shape, dtype, chunks) if "data_type" in document else None
    if problem is not None:
        raise cp.errors.MetadataError(
            f"{where} contradicts itself: {problem}. The array's metadata was edited or is "
            f"damaged; restore the checkpoint from a copy."
        )
    return shape, dtype, chunks


def _contradiction(
    document: Mapping[str, Any],
    shape: tuple[int, ...],
    dtype: np.dtype,
    chunks: tuple[int, ...] | None,
) -> str | None:
    """What a zarr v3 ``zarr.json`` says against itself (which TensorStore, and so every
    load, refuses), or ``None``: the checks a metadata read can afford without any data."""
    if chunks is not None and len(chunks) != len(shape):
        return f"its chunk_shape {list(chunks)} and its shape {list(shape)} differ in rank"
    fill = document.get("fill_value")
    if dtype.kind == "b" and type(fill) is not bool:
        return f"its data_type bool takes a fill_value of true or false, not {fill!r}"
    if dtype.kind == "c" and not (isinstance(fill, list) and len(fill) == 2):
        return f"its data_type {dtype.name} takes a fill_value of two numbers, not {fill!r}"
    if dtype.kind == "f" and (type(fill) is bool or not isinstance(fill, int | float | str)):
        return f"its data_type {dtype.name} takes a numeric fill_value, not {fill!r}"
    for codec in document.get("codecs") or ():
        inner = codec.get("configuration", {}).get("chunk_shape") if type(codec) is dict else None
        if codec.get("name") != "sharding_indexed" or chunks is None or type(inner) is not list:
            continue
        if len(inner) != len(chunks) or not all(
            type(i) is int and i > 0 and c % i == 0 for i, c in zip(inner, chunks, strict=False)
        ):
            return (
                f"its sharding codec's chunk_shape {inner} does not divide its chunk_shape "
                f"{list(chunks)}"
            )
    return None


def record_contradiction(
    shape: Sequence[int],
    dtype: Any,
    chunk_shape: Sequence[int] | None,
    *,
    recorded: tuple[Sequence[int], Any] | None = None,
    write_shape: Sequence[int] | None = None,
) -> str | None:
    """What an array's ``zarr.json`` (its ``shape``, ``dtype`` and ``chunk_shape``) says
    against what ``_METADATA`` recorded of it, or ``None``.

    ``recorded``: the shape and dtype this library records of every array. ``write_shape``:
    what Orbax records of a ``jax.Array`` (and this library too), the shape of each shard
    the save wrote: it lies within the array (no dimension larger), and the chunks divide
    it (Orbax's chunk shape is a divisor of it in every dimension; ours is it). Orbax
    records no dtype and no shape of an array: nothing else can be compared.
    """
    shape = tuple(int(s) for s in shape)
    if recorded is not None:
        recorded_shape = tuple(int(s) for s in recorded[0])
        if shape != recorded_shape or np.dtype(dtype) != np.dtype(recorded[1]):
            return (
                f"its zarr.json records shape {list(shape)} and dtype {np.dtype(dtype)}, but "
                f"_METADATA records shape {list(recorded_shape)} and dtype {np.dtype(recorded[1])}"
            )
    if write_shape is None:
        return None
    write = tuple(int(w) for w in write_shape)
    said = f"_METADATA records the write_shape {list(write)} (the shape of each shard saved)"
    # A dimension of size 0 is written in shards (and chunks) of 1: zarr has no empty chunk.
    if len(write) != len(shape) or any(w > max(1, s) for w, s in zip(write, shape, strict=False)):
        return f"its zarr.json records shape {list(shape)}, but {said}, which does not fit in it"
    chunks = tuple(int(c) for c in chunk_shape) if chunk_shape is not None else None
    if chunks is not None and (
        len(chunks) != len(write) or any(max(1, w) % c for w, c in zip(write, chunks, strict=True))
    ):
        return f"its zarr.json records chunk_shape {list(chunks)}, but {said}: it must divide it"
    return None


def contradiction_error(
    what: str, directory: os.PathLike[str] | str, name: str, problem: str
) -> cp.errors.MetadataError:
    """The error for an array whose ``zarr.json`` contradicts ``_METADATA``
    (``record_contradiction``'s ``problem``), naming ``what`` (the leaf's key path), the
    array's ``zarr.json`` and ``_METADATA`` in ``directory`` (the pytree's)."""
    root = os.fspath(directory)
    zarr_json = os.path.join(root, array_prefix(name) + "zarr.json")
    return cp.errors.MetadataError(
        f"{what} (array {name!r}): {problem}. Its zarr.json ({zarr_json}, a key of the "
        f"database in {root}) and {os.path.join(root, '_METADATA')} contradict each other: "
        f"the checkpoint's metadata was edited or is damaged; restore the checkpoint from a "
        f"copy."
    )


# Codecs that reorder a chunk's bytes without changing their size: this library never
# writes them, so an array of its own that names one was edited, and would load other values.
_REORDERING = ("transpose",)


def foreign_codec(codec_spec: Mapping[str, Any]) -> str | None:
    """The first codec of ``codec_spec`` (TensorStore's ``store.codec.to_json()``) that
    this library never writes and that would read its chunks as other values (big-endian
    bytes, a transpose), or ``None``."""
    pending = list(codec_spec.get("codecs") or ()) if isinstance(codec_spec, Mapping) else []
    while pending:
        codec = pending.pop(0)
        if type(codec) is not dict:
            continue
        name, configuration = codec.get("name"), codec.get("configuration") or {}
        if name in _REORDERING or (name == "bytes" and configuration.get("endian") == "big"):
            return json.dumps(codec, sort_keys=True)
        if name == "sharding_indexed":
            pending += configuration.get("codecs") or ()
    return None


def check_own_codecs(codec: Any, what: str) -> None:
    """Refuses an array this library wrote whose ``zarr.json`` names a codec it never
    writes (``foreign_codec``): loaded, the chunks would be other values. ``codec``: the
    opened store's ``codec`` (a ``ts.CodecSpec``, or ``None``).

    Raises:
      cp.errors.MetadataError: naming ``what`` (the leaf and array) and the codec.
    """
    codec = None if codec is None else foreign_codec(codec.to_json())
    if codec is not None:
        raise cp.errors.MetadataError(
            f"{what}: its zarr.json names the codec {codec}, which this library never writes "
            f"and which would load its chunks as other values: the array's metadata was "
            f"edited or is damaged; restore the checkpoint from a copy."
        )


class ZarrLayout:
    """Where one array lives and how it is chunked (never changed once made: often shared)."""

    __slots__ = ("chunk_nbytes", "chunk_shape", "direct_dtype", "dtype", "name", "shape")

    def __init__(
        self, name: str, shape: Sequence[int], dtype: Any, chunk_shape: Sequence[int]
    ) -> None:
        self.name = name
        self.shape = tuple(map(int, shape))
        self.dtype = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
        self.chunk_shape = self.shape if chunk_shape is shape else tuple(map(int, chunk_shape))
        # Bytes of one full chunk.
        self.chunk_nbytes = math.prod(self.chunk_shape) * self.dtype.itemsize
        # Whether chunks of this dtype can be encoded here (not only by the driver).
        self.direct_dtype = is_direct_dtype(self.dtype)

    def summary(self) -> dict[str, Any]:
        """Shape, zarr3 data type and chunk shape, as a leaf's metadata records them."""
        return {
            "shape": list(self.shape),
            "dtype": zarr_dtype_name(self.dtype),
            "chunk_shape": list(self.chunk_shape),
        }

    def region(self, index: Sequence[int]) -> tuple[slice, ...]:
        """The part of the array that chunk ``index`` covers (clipped at the edges)."""
        return tuple(
            slice(i * c, min((i + 1) * c, s))
            for i, c, s in zip(index, self.chunk_shape, self.shape, strict=True)
        )


@functools.lru_cache(maxsize=1 << 16)
def _layout_and_summary(
    name: str, shape: tuple[int, ...], dtype: np.dtype, chunk_shape: tuple[int, ...]
) -> tuple[ZarrLayout, dict[str, Any]]:
    layout = ZarrLayout(name, shape, dtype, chunk_shape)
    return layout, layout.summary()


def planned_layout(
    name: str, shape: tuple[int, ...], dtype: np.dtype, chunk_shape: tuple[int, ...]
) -> tuple[ZarrLayout, dict[str, Any]]:
    """The layout of an array to save and a fresh copy of its ``summary()``.

    Both depend only on the tree's structure: a training loop saving trees of
    one structure makes each once (the layout is shared: never change it).
    """
    layout, summary = _layout_and_summary(name, shape, dtype, chunk_shape)
    return layout, summary.copy()


def full_chunk(data: np.ndarray, layout: ZarrLayout) -> np.ndarray:
    """``data`` as a C-contiguous full chunk (edge chunks are padded with zeros)."""
    if data.shape != layout.chunk_shape:
        full = np.zeros(layout.chunk_shape, dtype=layout.dtype)
        full[tuple(slice(0, s) for s in data.shape)] = data
        return full
    return np.ascontiguousarray(data, dtype=layout.dtype)


@dataclasses.dataclass(slots=True)
class ArrayWrite:
    """One array to write: its layout and the chunks this process owns.

    ``chunks`` maps a chunk index to that chunk's data (edge chunks may be
    smaller than ``layout.chunk_shape``). Neither changes once the write is
    built. What depends on them is computed when asked, by the writer: a save
    builds one per array before its caller gets control back.
    """

    what: Any  # Names the leaf in errors (its str(), formatted only when needed).
    layout: ZarrLayout
    chunks: list[tuple[tuple[int, ...], np.ndarray]]
    inner_chunk_shape: tuple[int, ...] | None = None
    compression: bool = False
    write_metadata: bool = True

    @property
    def nbytes(self) -> int:
        """Bytes of data this process writes for the array."""
        chunks = self.chunks
        if len(chunks) == 1:
            return int(chunks[0][1].nbytes)
        return sum(int(data.nbytes) for _, data in chunks)

    @property
    def one_chunk_shards(self) -> bool:
        """Uncompressed, one inner chunk per shard: readable without the zarr3 driver."""
        return not self.compression and self.inner_chunk_shape in (None, self.layout.chunk_shape)

    @property
    def plain(self) -> bool:
        """Plain enough to be encoded without the zarr3 driver (also of a plain dtype)."""
        return self.layout.direct_dtype and self.one_chunk_shards

    @property
    def largest(self) -> int:
        """Bytes of its largest chunk, or of its chunks together if more."""
        return max(self.nbytes, self.layout.chunk_nbytes)

    def zarr_json(self) -> bytes:
        """The bytes of the array's ``zarr.json``."""
        layout = self.layout
        if self.one_chunk_shards:
            return zarr_json(layout.shape, layout.dtype, layout.chunk_shape)
        return json.dumps(self.metadata(), separators=(",", ":"), sort_keys=True).encode()

    def metadata(self) -> dict[str, Any]:
        """The zarr3 metadata of the array."""
        layout = self.layout
        return metadata_dict(
            layout.shape,
            layout.dtype,
            layout.chunk_shape,
            self.inner_chunk_shape,
            compression=self.compression,
        )
