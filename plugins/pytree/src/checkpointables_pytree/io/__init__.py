"""The writer and the reader: every array of one save, or of one load, moved in one run.

* ``Writer``: leaf handlers ``add`` an ``ArrayWrite`` per array; ``run``
  encodes plain arrays into the pytree's database (``ocdbt.DatabaseFiles``)
  and hands the others to the zarr3 driver (``ocdbt.DriverWrites``).
* ``Reader``: leaf handlers ``add_all`` an ``ArrayRead`` per array; ``run``
  reads plain shards in bulk (located by ``ocdbt.DatabaseIndex``, read by
  ``storage``'s local files or few ranged GETs, checked against their
  CRC-32C), small arrays many at a time (``read_small``), and the rest
  through TensorStore's zarr3 driver. Under a host-memory budget, large
  arrays are streamed: those this library wrote as byte ranges of their
  chunks (``chunk_pieces``), the others piece by piece through the driver.
  Without a budget, uncompressed arrays this library wrote of at least
  ``UNBOUNDED_STREAM_BYTES`` (or a process's part of one) take the same byte
  ranges, into each region's own buffer (at most ``UNBOUNDED_LIMIT`` of
  pieces in flight): no whole-array host copy.
* Under a host-memory budget, the chunk shape a save gives an array
  (``budget_chunk_shape``) and its chunks' offsets (``chunk_offsets``): the
  leaf handlers write them, incremental saves predict them.
* ``Staging``: the host bytes a save holds for writing, and the most at once.
* Multi-process saves: which shards this process writes
  (``shards_to_write``), and the merge of the per-process databases
  (``merge_process_databases``).

It imports ``ocdbt``, ``storage`` and ``zarr3``; the leaves' sessions drive it.
"""

from checkpointables_pytree.io._array_reads import (
    ArrayRead,
    Region,
    StoredArray,
    chunk_keys,
    convert_all,
    physical_memory_bytes,
    pieces_of,
)
from checkpointables_pytree.io._budget_chunks import (
    budget_chunk_shape,
    chunk_offsets,
    chunk_shape_within,
)
from checkpointables_pytree.io._multiprocess import (
    arrays_the_primary_lacks,
    chunk_shape_of,
    flush_database,
    merge_process_databases,
    shards_to_write,
)
from checkpointables_pytree.io._ranged_reads import chunk_pieces
from checkpointables_pytree.io._reader import (
    INLINE_READ_KEYS,
    REMOTE_UNBOUNDED_LIMIT,
    UNBOUNDED_LIMIT,
    UNBOUNDED_STREAM_BYTES,
    Reader,
    read_groups,
    read_values,
)
from checkpointables_pytree.io._remote_reads import requests_in_flight
from checkpointables_pytree.io._small_reads import Small, read_small
from checkpointables_pytree.io._staging import Staging
from checkpointables_pytree.io._streamed_reads import PieceSink, piece_bytes, pieces
from checkpointables_pytree.io._streamed_writes import ChunkSource, Streamed
from checkpointables_pytree.io._writer import DATABASE_LAYOUT, DIRECT_BYTES, Writer

__all__ = [
    "budget_chunk_shape",
    "chunk_offsets",
    "chunk_shape_within",
    "ArrayRead",
    "Region",
    "PieceSink",
    "chunk_pieces",
    "piece_bytes",
    "pieces",
    "ChunkSource",
    "Streamed",
    "StoredArray",
    "chunk_keys",
    "convert_all",
    "physical_memory_bytes",
    "pieces_of",
    "arrays_the_primary_lacks",
    "flush_database",
    "merge_process_databases",
    "shards_to_write",
    "chunk_shape_of",
    "INLINE_READ_KEYS",
    "REMOTE_UNBOUNDED_LIMIT",
    "UNBOUNDED_LIMIT",
    "UNBOUNDED_STREAM_BYTES",
    "Reader",
    "read_groups",
    "read_values",
    "requests_in_flight",
    "Small",
    "read_small",
    "Staging",
    "DIRECT_BYTES",
    "Writer",
    "DATABASE_LAYOUT",
]
