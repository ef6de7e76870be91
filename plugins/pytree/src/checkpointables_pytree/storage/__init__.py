"""Where a checkpoint's bytes live and how they are reached, below any format.

* object stores (``s3://``, ``gs://``): TensorStore kvstore specs and context
  resources from the user's configuration (``StorageOptions``, ``kvstore_spec``,
  ``context_resources``), and the ``cp.storage`` backend for those schemes
  (``storage_for``), registered by ``plugin.py``;
* server-side copies of S3 objects (``copy_objects``, ``list_objects``), for
  incremental saves, and large objects uploaded in bounded parts
  (``upload_in_parts``): botocore's client, configured as TensorStore's spec;
* local files read without TensorStore (``OpenFiles``, ``read_values``,
  ``read_into``: ``preadv`` into the arrays' own memory) and the aligned
  buffers they fill (``Slab``, ``aligned_empty``);
* waiting for many TensorStore futures from an event loop (``wait_all``,
  ``settle``, ``gather_settled``, ``ByteLimiter``);
* TensorStore's failures turned into the library's documented errors
  (``storage_error``, ``integrity_error``, ``object_store_failures``; a chunk the
  database lacks is a ``MissingChunkError``, which a process-local load tells from
  damage), and array names that would lead out of a checkpoint refused
  (``array_directory``).

It imports nothing of the plugin's; the OCDBT room and the writer and reader
build on it.
"""

from checkpointables_pytree.storage._backend import storage_for
from checkpointables_pytree.storage._buffers import (
    ALIGNMENT,
    Slab,
    aligned_empty,
    give_back_free_memory,
)
from checkpointables_pytree.storage._errors import (
    MissingChunkError,
    array_directory,
    describe_type,
    integrity_error,
    listing,
    missing_chunk_error,
    object_store_failures,
    storage_error,
    write_error,
)
from checkpointables_pytree.storage._local_files import (
    SLAB_BYTES,
    OpenFiles,
    ValueLocation,
    read_into,
    read_range,
    read_values,
)
from checkpointables_pytree.storage._object_store import (
    SCHEMES,
    context_resources,
    kvstore_spec,
    s3_settings,
)
from checkpointables_pytree.storage._options import StorageOptions
from checkpointables_pytree.storage._server_copy import (
    ObjectInfo,
    ServerCopy,
    can_copy_on_server,
    copy_objects,
    list_objects,
)
from checkpointables_pytree.storage._ts_futures import ByteLimiter, gather_settled, settle, wait_all
from checkpointables_pytree.storage._uploads import (
    UPLOAD_HELD_BYTES,
    UPLOAD_IN_PARTS_BYTES,
    upload_in_parts,
    uploaded_in_parts,
)

__all__ = [
    "UPLOAD_HELD_BYTES",
    "UPLOAD_IN_PARTS_BYTES",
    "upload_in_parts",
    "uploaded_in_parts",
    "gather_settled",
    "StorageOptions",
    "storage_for",
    "ALIGNMENT",
    "Slab",
    "aligned_empty",
    "give_back_free_memory",
    "describe_type",
    "array_directory",
    "integrity_error",
    "MissingChunkError",
    "missing_chunk_error",
    "listing",
    "object_store_failures",
    "storage_error",
    "write_error",
    "OpenFiles",
    "SLAB_BYTES",
    "ValueLocation",
    "read_into",
    "read_range",
    "read_values",
    "SCHEMES",
    "context_resources",
    "kvstore_spec",
    "s3_settings",
    "ObjectInfo",
    "ServerCopy",
    "can_copy_on_server",
    "copy_objects",
    "list_objects",
    "ByteLimiter",
    "settle",
    "wait_all",
]
