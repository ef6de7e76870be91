"""checkpointables plugin: pytrees of arrays, PRNG keys, scalars and strings, in Orbax's format.

Installed with ``pip install checkpointables`` and found through the entry
point ``pytree`` (module ``checkpointables_pytree.plugin``); use it through
``cp.save_pytree`` / ``cp.load_pytree``::

    import checkpointables as cp

    cp.save_pytree(path, {"params": params, "step": 10})
    state = cp.load_pytree(path)                                  # as saved, on any machine
    state = cp.load_pytree(path, cp.pytree_metadata(path).metadata)

The classes here are for plugin authors, for ``isinstance`` checks on what
``cp.pytree_metadata`` returns, and the plugin's options (TensorStore and S3
settings), which ``cp.Context`` takes as ``array_options`` and
``storage_options``::

    with cp.Context(array_options=cp.options.ArrayOptions(use_compression=True)):
        cp.save_pytree(path, state)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from checkpointables.lazy import first_use_attributes

if TYPE_CHECKING:
    from checkpointables_pytree._handler import PyTreeHandler
    from checkpointables_pytree._maintenance import record_checksums_again
    from checkpointables_pytree.leaves import (
        FAST_PATH_ENVIRONMENT_VARIABLE,
        AbstractPRNGKey,
        ArrayLeafHandler,
        ArrayMetadata,
        ArrayOptions,
        ArrayStorageOptions,
        BytesLeafHandler,
        BytesMetadata,
        NumpyLeafHandler,
        NumpyMetadata,
        PRNGKeyLeafHandler,
        PRNGKeyMetadata,
        ScalarLeafHandler,
        StorageMetadata,
        StringLeafHandler,
        choose_inner_chunk_shape,
    )
    from checkpointables_pytree.storage import StorageOptions

__all__ = [
    # The checkpointable handler.
    "PyTreeHandler",
    # Leaf handlers.
    "ArrayLeafHandler",
    "NumpyLeafHandler",
    "ScalarLeafHandler",
    "StringLeafHandler",
    "BytesLeafHandler",
    "PRNGKeyLeafHandler",
    # Typed PRNG keys: the abstract type their handler loads into.
    "AbstractPRNGKey",
    # What cp.pytree_metadata returns for array, key and bytes leaves.
    "ArrayMetadata",
    "BytesMetadata",
    "NumpyMetadata",
    "PRNGKeyMetadata",
    "StorageMetadata",
    # Storage helpers.
    "choose_inner_chunk_shape",
    # The plugin's options (cp.Context keywords array_options and storage_options; also
    # cp.options.ArrayOptions, cp.options.ArrayStorageOptions, cp.options.StorageOptions).
    "ArrayOptions",
    "ArrayStorageOptions",
    "StorageOptions",
    # Set to 0 to turn ArrayOptions.ocdbt_fast_path off by default.
    "FAST_PATH_ENVIRONMENT_VARIABLE",
    # After rewriting a saved database on purpose: its checksums recorded anew.
    "record_checksums_again",
]


# Imported on first use: the plugin's entry point (plugin.py) is imported at every
# discovery, `checkpointables --help` too, which needs no JAX. Name -> its module.
_LAZY_NAMES: dict[str, str] = {
    "PyTreeHandler": "checkpointables_pytree._handler",
    "record_checksums_again": "checkpointables_pytree._maintenance",
    "FAST_PATH_ENVIRONMENT_VARIABLE": "checkpointables_pytree.leaves",
    "AbstractPRNGKey": "checkpointables_pytree.leaves",
    "ArrayLeafHandler": "checkpointables_pytree.leaves",
    "ArrayMetadata": "checkpointables_pytree.leaves",
    "ArrayOptions": "checkpointables_pytree.leaves",
    "ArrayStorageOptions": "checkpointables_pytree.leaves",
    "BytesLeafHandler": "checkpointables_pytree.leaves",
    "BytesMetadata": "checkpointables_pytree.leaves",
    "NumpyLeafHandler": "checkpointables_pytree.leaves",
    "NumpyMetadata": "checkpointables_pytree.leaves",
    "PRNGKeyLeafHandler": "checkpointables_pytree.leaves",
    "PRNGKeyMetadata": "checkpointables_pytree.leaves",
    "ScalarLeafHandler": "checkpointables_pytree.leaves",
    "StorageMetadata": "checkpointables_pytree.leaves",
    "StringLeafHandler": "checkpointables_pytree.leaves",
    "choose_inner_chunk_shape": "checkpointables_pytree.leaves",
    "StorageOptions": "checkpointables_pytree.storage",
}


if not TYPE_CHECKING:  # Type checkers see the imports above, so a typo stays an error.
    __getattr__, __dir__ = first_use_attributes(__name__, _LAZY_NAMES, __all__)
