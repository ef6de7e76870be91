"""The pytree plugin's hook implementations (entry point ``pytree`` in group ``checkpointables``).

It registers ``PyTreeHandler`` under the name ``pytree`` at priority 90, after
the JSON handler (60), so plain JSON-like objects stay human-readable and
everything holding arrays comes here, the standard leaf handlers, the
``s3://`` and ``gs://`` storage, and its options (``array_options``,
``storage_options``).
Checkpoints record Orbax's typestr for it, so Orbax reads them with its own
handler; Orbax V0's typestrs are secondary typestrs, so its checkpoints load too.
"""

from __future__ import annotations

from typing import Any

import checkpointables as cp

# The hooks import what they register (JAX, TensorStore): importing this module is
# cheap, so that `checkpointables --help`, which calls only `register_commands`, is too.

PRIORITY = 90


@cp.hookimpl
def register_checkpointable_handlers(register: Any) -> None:
    """Registers ``PyTreeHandler`` as ``pytree`` (priority 90), recorded as Orbax's handler."""
    from checkpointables_pytree._handler import ORBAX_TYPESTR, READABLE_TYPESTRS, PyTreeHandler

    register(
        PyTreeHandler,
        priority=PRIORITY,
        name="pytree",
        typestr=ORBAX_TYPESTR,
        secondary_typestrs=READABLE_TYPESTRS,
    )


@cp.hookimpl
def register_leaf_handlers(register: Any) -> None:
    """Registers leaf handlers for arrays, typed PRNG keys, scalars, ``str`` and ``bytes``."""
    import jax
    import numpy as np
    from checkpointables.serialization import AbstractArray, AbstractShardedArray

    from checkpointables_pytree.leaves import (
        BYTES,
        JAX_ARRAY,
        NUMPY_ARRAY,
        PRNG_KEY,
        SCALAR,
        STRING,
        AbstractPRNGKey,
        ArrayLeafHandler,
        BytesLeafHandler,
        NumpyLeafHandler,
        PRNGKeyLeafHandler,
        ScalarLeafHandler,
        StringLeafHandler,
        key_array_type,
    )

    register(jax.Array, AbstractShardedArray, ArrayLeafHandler, secondary_typestrs=(JAX_ARRAY,))
    # Key arrays are jax.Arrays in Orbax's format; their own value type tells them apart.
    register(
        key_array_type(),
        AbstractPRNGKey,
        PRNGKeyLeafHandler,
        secondary_typestrs=(JAX_ARRAY, PRNG_KEY),
    )
    register(np.ndarray, AbstractArray, NumpyLeafHandler, secondary_typestrs=(NUMPY_ARRAY,))
    # Scalars: each type is its own abstract type (0.0 loads a float, np.float32(0) a
    # np.float32). np.generic covers NumPy and ml_dtypes scalars; np.str_ and np.bytes_ are
    # also str and bytes, which come first in their MRO.
    for scalar_type in (int, float, bool, complex, np.generic):
        register(scalar_type, scalar_type, ScalarLeafHandler, secondary_typestrs=(SCALAR,))
    register(str, str, StringLeafHandler, secondary_typestrs=(STRING,))
    # Bytes are uint8 arrays: Orbax, which has no bytes leaves, reads them as np.ndarray.
    register(bytes, bytes, BytesLeafHandler, secondary_typestrs=(NUMPY_ARRAY, BYTES))


@cp.hookimpl
def register_storage(register: Any) -> None:
    """Registers ``s3://`` and ``gs://`` storage, through TensorStore's key-value stores."""
    from checkpointables_pytree import storage

    for scheme in storage.SCHEMES:
        register(scheme, storage.storage_for)


@cp.hookimpl
def register_options(register: Any) -> None:
    """Adds the plugin's settings to ``cp.Context``: ``array_options`` (zarr3 chunks, zstd,
    checksums) and ``storage_options`` (S3 and GCS through TensorStore)."""
    from checkpointables_pytree import leaves, storage

    register("array_options", leaves.ArrayOptions, parts=(leaves.ArrayStorageOptions,))
    register("storage_options", storage.StorageOptions)
