"""TODO room docstring."""

from checkpointables_pytree.ocdbt._btree_nodes import LeafNode, decode, decoded, split_location
from checkpointables_pytree.ocdbt._context import (
    MANIFEST_FILE,
    OCDBT_CONFIG,
    SAVE_OCDBT_CACHE_BYTES,
    Source,
    database_directory,
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
    write_local_file,
    write_rest,
)
from checkpointables_pytree.ocdbt._driver_writes import (
    LARGE_GROUP_BYTES,
    WRITER_PREFIX,
    DriverWrites,
)
from checkpointables_pytree.ocdbt._format import MAX_NODE_BYTES
from checkpointables_pytree.ocdbt._index import (
    PREFETCH_METADATA_BYTES,
    DatabaseIndex,
    OpenedDatabase,
    ValueLocation,
    dump,
    leaks,
    locate,
    parse_location,
)

__all__ = [
    "LeafNode",
    "decode",
    "decoded",
    "split_location",
    "MANIFEST_FILE",
    "OCDBT_CONFIG",
    "SAVE_OCDBT_CACHE_BYTES",
    "Source",
    "database_directory",
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
    "dump",
    "leaks",
    "locate",
    "parse_location",
]
