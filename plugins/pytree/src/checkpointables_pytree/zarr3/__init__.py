"""TODO room docstring."""

from checkpointables_pytree.zarr3._encoding import (
    SHARD_TRAILER_BYTES,
    ArrayWrite,
    ZarrLayout,
    all_chunk_indices,
    chunk_key,
    default_chunk_shape,
    encode_shard,
    full_chunk,
    metadata_dict,
    planned_layout,
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
    "chunk_key",
    "default_chunk_shape",
    "encode_shard",
    "full_chunk",
    "metadata_dict",
    "planned_layout",
    "shard_trailer",
    "zarr_dtype_name",
    "zarr_json",
    "zarr_shape_dtype",
]
