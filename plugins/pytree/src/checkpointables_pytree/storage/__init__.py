"""TODO room docstring."""

from checkpointables_pytree.storage._backend import storage_for
from checkpointables_pytree.storage._buffers import ALIGNMENT, Slab, aligned_empty
from checkpointables_pytree.storage._errors import (
    describe_type,
    integrity_error,
    listing,
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
from checkpointables_pytree.storage._ts_futures import ByteLimiter, settle, wait_all

__all__ = [
    "storage_for",
    "ALIGNMENT",
    "Slab",
    "aligned_empty",
    "describe_type",
    "integrity_error",
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
    "ByteLimiter",
    "settle",
    "wait_all",
]
