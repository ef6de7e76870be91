"""The leaf handlers (arrays, typed PRNG keys, scalars, ``str``, ``bytes``) and their sessions.

``SaveSession`` and ``LoadSession`` are what one save or load shares between
the standard leaf handlers: the writer or reader, the ``_METADATA`` records,
the strings file. A save hands each handler its leaves as one ``LeafGroup``;
the array handlers plan the zarr3 layouts once per tree structure
(``_array_layouts``) and add every array to the session's writer; a load's
handlers add ``ArrayRead``s to its reader and build their leaves from what is
read. ``ArrayMetadata`` and friends are what ``cp.pytree_metadata`` returns.
``ArrayOptions`` and ``ArrayStorageOptions`` are how they store arrays (the
``array_options`` of ``cp.Context``, registered by ``plugin.py``).

It imports ``io``, ``ocdbt``, ``storage``, ``tree`` and ``zarr3``; the
package's top modules (``PyTreeHandler``, the save and load plans) use it.
"""

from checkpointables_pytree.io import chunk_shape_within
from checkpointables_pytree.leaves._array_handlers import ArrayLeafHandler, NumpyLeafHandler
from checkpointables_pytree.leaves._common import (
    ARRAY_VALUE_TYPES,
    BYTES,
    JAX_ARRAY,
    NUMPY_ARRAY,
    SCALAR,
    STRING,
)
from checkpointables_pytree.leaves._groups import ArrayRecords, LeafGroup
from checkpointables_pytree.leaves._host_copies import host_copies
from checkpointables_pytree.leaves._keys import (
    PRNG_KEY,
    AbstractPRNGKey,
    PRNGKeyLeafHandler,
    PRNGKeyMetadata,
    key_array_type,
    key_impl_problems,
    mark_orbax_keys,
)
from checkpointables_pytree.leaves._metadata import (
    ArrayMetadata,
    BytesMetadata,
    NumpyMetadata,
    StorageMetadata,
)
from checkpointables_pytree.leaves._options import (
    FAST_PATH_ENVIRONMENT_VARIABLE,
    ArrayOptions,
    ArrayStorageOptions,
)
from checkpointables_pytree.leaves._pieces import DeviceSink, HostSink
from checkpointables_pytree.leaves._scalar_handler import ScalarLeafHandler
from checkpointables_pytree.leaves._session import (
    ARRAY_METADATAS_DIR,
    STRINGS_FILE,
    LoadSession,
    NamedDeserializationParam,
    NamedSerializationParam,
    PyTreeDeserializationContext,
    PyTreeSerializationContext,
    SaveSession,
    write_text,
)
from checkpointables_pytree.leaves._streamed_saves import streamed_host_block
from checkpointables_pytree.leaves._text_handlers import BytesLeafHandler, StringLeafHandler
from checkpointables_pytree.zarr3 import choose_inner_chunk_shape

__all__ = [
    "chunk_shape_within",
    "host_copies",
    "streamed_host_block",
    "DeviceSink",
    "HostSink",
    "ArrayOptions",
    "FAST_PATH_ENVIRONMENT_VARIABLE",
    "ArrayStorageOptions",
    "ArrayLeafHandler",
    "NumpyLeafHandler",
    "ARRAY_VALUE_TYPES",
    "BYTES",
    "JAX_ARRAY",
    "NUMPY_ARRAY",
    "SCALAR",
    "STRING",
    "choose_inner_chunk_shape",
    "ArrayRecords",
    "LeafGroup",
    "AbstractPRNGKey",
    "PRNGKeyLeafHandler",
    "PRNGKeyMetadata",
    "PRNG_KEY",
    "key_array_type",
    "mark_orbax_keys",
    "key_impl_problems",
    "ArrayMetadata",
    "BytesMetadata",
    "NumpyMetadata",
    "StorageMetadata",
    "ScalarLeafHandler",
    "ARRAY_METADATAS_DIR",
    "LoadSession",
    "NamedDeserializationParam",
    "NamedSerializationParam",
    "PyTreeDeserializationContext",
    "PyTreeSerializationContext",
    "STRINGS_FILE",
    "SaveSession",
    "write_text",
    "BytesLeafHandler",
    "StringLeafHandler",
]
