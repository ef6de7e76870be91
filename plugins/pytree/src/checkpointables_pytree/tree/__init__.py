"""What a checkpoint says about the tree: its key paths, its ``_METADATA`` and its ``_sharding``.

A save flattens a pytree into key paths and leaves (``flatten``, with the
structure cached per tree definition in ``Structure``), records every key
path, key type and value type in ``_METADATA`` (``write_tree_metadata``) and
every ``jax.Array``'s sharding in ``_sharding``; a load parses them
(``read_tree_metadata``, ``read_sharding_file``) and rebuilds nested dicts
(with their ``int`` keys), lists and tuples from the recorded key paths
(``unflatten``), all in Orbax's format. Nothing here reads or writes an
array: this room imports nothing of the plugin's, and every other room may
import it.
"""

from checkpointables_pytree.tree._keypaths import (
    DICT,
    EMPTY_DICT,
    EMPTY_TYPES,
    SEQUENCE,
    Flat,
    Leaf,
    Structure,
    flatten,
    flatten_abstract,
    is_int_key,
    jax_keypath,
    key_names,
    key_type,
    keypath_str,
    keystr,
)
from checkpointables_pytree.tree._metadata_file import (
    INT_KEYS,
    METADATA_FILE,
    OWN_VALUE_TYPE,
    PROCESS_LOCAL,
    Entry,
    TreeMetadata,
    compact_encoder,
    entries_by_names,
    entry_head,
    entry_tail,
    parse_tree_metadata,
    parse_tree_metadata_uncached,
    read_tree_metadata,
    write_tree_metadata,
)
from checkpointables_pytree.tree._rebuild import MAX_DEPTH, MAX_PADDING, Recipe, unflatten
from checkpointables_pytree.tree._sharding import (
    SHARDING_FILE,
    describe,
    device_count,
    file_key,
    read_sharding_file,
    rebuild,
    summary,
    write_sharding_file,
)

__all__ = [
    "Leaf",
    "DICT",
    "EMPTY_DICT",
    "EMPTY_TYPES",
    "Flat",
    "SEQUENCE",
    "Structure",
    "flatten",
    "flatten_abstract",
    "is_int_key",
    "jax_keypath",
    "key_names",
    "key_type",
    "keystr",
    "keypath_str",
    "Entry",
    "INT_KEYS",
    "PROCESS_LOCAL",
    "METADATA_FILE",
    "OWN_VALUE_TYPE",
    "TreeMetadata",
    "parse_tree_metadata_uncached",
    "compact_encoder",
    "entries_by_names",
    "entry_head",
    "entry_tail",
    "parse_tree_metadata",
    "read_tree_metadata",
    "write_tree_metadata",
    "Recipe",
    "unflatten",
    "MAX_DEPTH",
    "MAX_PADDING",
    "SHARDING_FILE",
    "describe",
    "device_count",
    "file_key",
    "read_sharding_file",
    "rebuild",
    "summary",
    "write_sharding_file",
]
