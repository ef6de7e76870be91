"""checkpointables: checkpointing for JAX.

Example::

    import checkpointables as cp

    cp.save_pytree("/tmp/ckpt", {"params": params, "step": 10})
    state = cp.load_pytree("/tmp/ckpt")
"""

from __future__ import annotations

from checkpointables import (
    context,
    errors,
    execution,
    handlers,
    hookspecs,
    layout,
    metadata_checksums,
    multihost,
    options,
    partial,
    path,
    plugins,
    progress,
    protocols,
    readers,
    reuse,
    safe_json,
    serialization,
    staging,
    storage,
    training,
)
from checkpointables._asyncio import AsyncResponse
from checkpointables._loading import (
    checkpointables_metadata,
    load_checkpointables,
    load_checkpointables_async,
)
from checkpointables._pytree_api import (
    load_pytree,
    load_pytree_async,
    pytree_metadata,
    save_pytree,
    save_pytree_async,
)
from checkpointables._saving import save_checkpointables, save_checkpointables_async
from checkpointables.checkpoint_metadata import CheckpointMetadata
from checkpointables.context import Context, configure
from checkpointables.hookspecs import hookimpl
from checkpointables.layout import is_checkpoint
from checkpointables.protocols import CheckpointableHandler, StatefulCheckpointable

__version__ = "0.1.0"

PLACEHOLDER = ...
"""In an abstract tree: skip this leaf (the result holds ``PLACEHOLDER`` there)."""

# Short aliases, as in Orbax's current API.
save = save_pytree
save_async = save_pytree_async
load = load_pytree
load_async = load_pytree_async
metadata = pytree_metadata

__all__ = [
    # Free functions.
    "save_pytree",
    "save_pytree_async",
    "load_pytree",
    "load_pytree_async",
    "pytree_metadata",
    "save_checkpointables",
    "save_checkpointables_async",
    "load_checkpointables",
    "load_checkpointables_async",
    "checkpointables_metadata",
    "save",
    "save_async",
    "load",
    "load_async",
    "metadata",
    "is_checkpoint",
    "PLACEHOLDER",
    # Types.
    "AsyncResponse",
    "CheckpointMetadata",
    "CheckpointableHandler",
    "StatefulCheckpointable",
    "Context",
    "configure",
    "hookimpl",
    # Modules.
    "context",
    "errors",
    "execution",
    "handlers",
    "hookspecs",
    "layout",
    "metadata_checksums",
    "multihost",
    "options",
    "partial",
    "path",
    "plugins",
    "progress",
    "protocols",
    "readers",
    "reuse",
    "safe_json",
    "serialization",
    "staging",
    "storage",
    "training",
]
