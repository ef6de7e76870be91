"""The zarr v3 encoding of arrays, as Orbax (through TensorStore's zarr3 driver) stores them.

An array is a ``zarr.json`` (``zarr_json``: shape, dtype, chunk grid and
codecs) and one key per chunk (``chunk_key``), each a sharding-codec shard:
the chunk's bytes, their CRC-32C, then the shard index and its CRC-32C
(``encode_shard``, ``shard_end``, ``shard_trailer``), split into inner
chunks when a save asks for a chunk size (``inner_chunk_shape``: the one
definition saves and reuse's checks share). ``ZarrLayout`` is one array's
planned layout and ``ArrayWrite`` what a save hands the writer for it. Pure
encoding: no I/O, nothing of the plugin imported, so the writer, the reader
and the OCDBT room share one definition of the bytes.
"""

from checkpointables_pytree.zarr3._encoding import (
    SHARD_TRAILER_BYTES,
    ArrayWrite,
    ZarrLayout,
    all_chunk_indices,
    array_prefix,
    check_own_codecs,
    choose_inner_chunk_shape,
    chunk_key,
    contradiction_error,
    default_chunk_shape,
    encode_shard,
    full_chunk,
    inner_chunk_shape,
    metadata_dict,
    planned_layout,
    record_contradiction,
    shard_end,
    shard_trailer,
    zarr_dtype_name,
    zarr_json,
    zarr_shape_dtype,
)

__all__ = [
    "ArrayWrite",
    "SHARD_TRAILER_BYTES",
    "ZarrLayout",
    "all_chunk_indices",
    "array_prefix",
    "check_own_codecs",
    "choose_inner_chunk_shape",
    "contradiction_error",
    "chunk_key",
    "default_chunk_shape",
    "encode_shard",
    "full_chunk",
    "inner_chunk_shape",
    "metadata_dict",
    "planned_layout",
    "record_contradiction",
    "shard_end",
    "shard_trailer",
    "zarr_dtype_name",
    "zarr_json",
    "zarr_shape_dtype",
]
