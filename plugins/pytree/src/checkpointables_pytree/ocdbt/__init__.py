"""The OCDBT key-value database of a pytree directory, in TensorStore's format: one room.

Every array of a pytree is a set of keys of one OCDBT database (Orbax's
layout). What this room does itself, and what it leaves to TensorStore:

* **Written here** (the fast path of a save, ``DatabaseFiles``,
  ``DatabaseLayout``): a *new* database that no one else writes, with one
  version: data files ``d/<32 hex digits>`` written from the arrays' own
  memory, values of at most ``MAX_INLINE_VALUE_BYTES`` inline in the leaf
  nodes, uncompressed b-tree nodes (leaves, and one interior node when there
  are several), and a manifest of the single-file kind, all encoded by
  ``_format`` from TensorStore's "ocdbt Key-Value Store driver" / "Storage
  format" documentation.
* **Read here** (the fast path of a load, ``DatabaseIndex``): the manifest and
  *uncompressed* b-tree nodes, decoded column by column (``decode``), to find
  where each value lies so that values are read in bulk (``storage`` and the
  reader's small and remote reads).
* **Left to TensorStore**: every database it or Orbax wrote (zstd-compressed
  nodes are handed to ``ts.ocdbt.dump``, at most once per node while its results
  leak; any node we cannot vouch for to the
  kvstore), arrays written through the zarr3 driver (``DriverWrites``: large,
  compressed, finely chunked or int4 arrays, in transactions of their own
  writers), merges of databases (``merge_into``: ``experimental_copy_range_to``
  in one atomic transaction), and every read the fast path declines.
* **Vouched for here** (``record_node_checksums``, ``node_checksum_problems``,
  ``start_node_check``): the SHA-256 of every b-tree node of a saved database,
  in ``_btree_checksums`` (covered by the commit's ``_CHECKSUMS``, as the
  manifest is), which verify checks, and loads check before anything (the
  index or TensorStore) reads the database. A database without that list
  (Orbax's) has every node's location bounded first (``bound_nodes``), so no
  forged location makes TensorStore read a node as large as its file.
* **Made here, once** (``make_directories``): the database's directory and
  ``d/``; a write that finds them gone fails, naming them, rather than make
  them again inside a temporary directory another process deleted. A large
  remote data file of an incremental save is uploaded in parts
  (``storage.upload_in_parts``).

The fast path can be turned off per save and per load (``docs/pytree.md``);
then TensorStore writes and reads every key. It is held to TensorStore by
tests: TensorStore's ``ocdbt`` and ``zarr3`` drivers and ``ts.ocdbt.dump`` read
what ``DatabaseFiles`` writes bit-exact, TensorStore commits on top of it, and
the index decodes what TensorStore writes or declines it
(``tests/plugins/pytree/ocdbt/test_ocdbt_conformance.py``). It imports ``storage``
and ``zarr3`` only.
"""

from checkpointables_pytree.ocdbt._btree_nodes import (
    MAX_ENCODED_NODE_BYTES,
    LeafNode,
    decode,
    decoded,
    split_location,
)
from checkpointables_pytree.ocdbt._btree_nodes import check_length as check_node_length
from checkpointables_pytree.ocdbt._context import (
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    OCDBT_CONFIG,
    SAVE_OCDBT_CACHE_BYTES,
    Source,
    check_manifest_size,
    database_directory,
    flush_data_files,
    is_local,
    kvstore_spec,
    location_spec,
    make_context,
    merge_into,
    open_kvstore,
)
from checkpointables_pytree.ocdbt._database_writer import (
    MAX_INLINE_VALUE_BYTES,
    DatabaseFiles,
    DatabaseLayout,
    DataFile,
    Deferred,
    Linked,
    link_files,
    make_directories,
    write_local_file,
    write_rest,
)
from checkpointables_pytree.ocdbt._driver_writes import (
    LARGE_GROUP_BYTES,
    WRITER_PREFIX,
    DriverWrites,
)
from checkpointables_pytree.ocdbt._dumps import CACHED_DUMPS, dump, dump_leaks
from checkpointables_pytree.ocdbt._format import MAX_NODE_BYTES
from checkpointables_pytree.ocdbt._index import (
    PREFETCH_METADATA_BYTES,
    DatabaseIndex,
    OpenedDatabase,
    ValueLocation,
    locate,
    parse_location,
    start_node_check,
    wait_for_node_check,
)
from checkpointables_pytree.ocdbt._node_checksums import (
    NODE_CHECKSUMS_FILE,
    bound_nodes,
    check_manifest,
    check_recorded_nodes,
    node_checksum_problems,
    node_checksums,
    record_node_checksums,
)
from checkpointables_pytree.ocdbt._statistics import stored_key_count

__all__ = [
    "MAX_ENCODED_NODE_BYTES",
    "LeafNode",
    "check_node_length",
    "decode",
    "decoded",
    "split_location",
    "MANIFEST_FILE",
    "MAX_MANIFEST_BYTES",
    "OCDBT_CONFIG",
    "SAVE_OCDBT_CACHE_BYTES",
    "Source",
    "check_manifest_size",
    "database_directory",
    "flush_data_files",
    "is_local",
    "kvstore_spec",
    "location_spec",
    "make_context",
    "merge_into",
    "open_kvstore",
    "DataFile",
    "DatabaseFiles",
    "DatabaseLayout",
    "Deferred",
    "Linked",
    "link_files",
    "make_directories",
    "MAX_INLINE_VALUE_BYTES",
    "write_local_file",
    "write_rest",
    "DriverWrites",
    "LARGE_GROUP_BYTES",
    "WRITER_PREFIX",
    "MAX_NODE_BYTES",
    "DatabaseIndex",
    "OpenedDatabase",
    "PREFETCH_METADATA_BYTES",
    "ValueLocation",
    "CACHED_DUMPS",
    "dump",
    "dump_leaks",
    "locate",
    "parse_location",
    "stored_key_count",
    "NODE_CHECKSUMS_FILE",
    "bound_nodes",
    "check_manifest",
    "check_recorded_nodes",
    "node_checksums",
    "record_node_checksums",
    "node_checksum_problems",
    "start_node_check",
    "wait_for_node_check",
]
