"""TODO room docstring."""

from checkpointables_pytree.io._array_reads import (
    ArrayRead,
    StoredArray,
    chunk_keys,
    convert_all,
    physical_memory_bytes,
    pieces_of,
)
from checkpointables_pytree.io._multiprocess import (
    arrays_the_primary_lacks,
    flush_database,
    merge_process_databases,
    shards_to_write,
)
from checkpointables_pytree.io._reader import INLINE_READ_KEYS, Reader, read_groups, read_values
from checkpointables_pytree.io._remote_reads import requests_in_flight
from checkpointables_pytree.io._small_reads import Small, read_small
from checkpointables_pytree.io._writer import DATABASE_LAYOUT, DIRECT_BYTES, Writer

__all__ = [
    "ArrayRead",
    "StoredArray",
    "chunk_keys",
    "convert_all",
    "physical_memory_bytes",
    "pieces_of",
    "arrays_the_primary_lacks",
    "flush_database",
    "merge_process_databases",
    "shards_to_write",
    "INLINE_READ_KEYS",
    "Reader",
    "read_groups",
    "read_values",
    "requests_in_flight",
    "Small",
    "read_small",
    "DIRECT_BYTES",
    "Writer",
    "DATABASE_LAYOUT",
]
