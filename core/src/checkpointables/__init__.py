"""checkpointables: checkpointing for JAX.

Example::

    import checkpointables as cp

    cp.save_pytree("/tmp/ckpt", {"params": params, "step": 10})
    state = cp.load_pytree("/tmp/ckpt")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from checkpointables.lazy import first_use_attributes

if TYPE_CHECKING:
    from checkpointables import (
        context,
        errors,
        execution,
        handlers,
        hookspecs,
        layout,
        lazy,
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

if TYPE_CHECKING:  # Short aliases, as in Orbax's current API.
    from checkpointables._pytree_api import load_pytree as load
    from checkpointables._pytree_api import load_pytree_async as load_async
    from checkpointables._pytree_api import pytree_metadata as metadata
    from checkpointables._pytree_api import save_pytree as save
    from checkpointables._pytree_api import save_pytree_async as save_async

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
    "lazy",
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

# Imported on first use, not with the package: the command line (`checkpointables --help`)
# and plugin discovery need a few small modules, not JAX and TensorStore. Each name: the
# module defining it, and its name there.
_LAZY_NAMES: dict[str, tuple[str, str]] = {
    "AsyncResponse": ("checkpointables._asyncio", "AsyncResponse"),
    "checkpointables_metadata": ("checkpointables._loading", "checkpointables_metadata"),
    "load_checkpointables": ("checkpointables._loading", "load_checkpointables"),
    "load_checkpointables_async": ("checkpointables._loading", "load_checkpointables_async"),
    "load_pytree": ("checkpointables._pytree_api", "load_pytree"),
    "load_pytree_async": ("checkpointables._pytree_api", "load_pytree_async"),
    "pytree_metadata": ("checkpointables._pytree_api", "pytree_metadata"),
    "save_pytree": ("checkpointables._pytree_api", "save_pytree"),
    "save_pytree_async": ("checkpointables._pytree_api", "save_pytree_async"),
    "save_checkpointables": ("checkpointables._saving", "save_checkpointables"),
    "save_checkpointables_async": ("checkpointables._saving", "save_checkpointables_async"),
    "CheckpointMetadata": ("checkpointables.checkpoint_metadata", "CheckpointMetadata"),
    "Context": ("checkpointables.context", "Context"),
    "configure": ("checkpointables.context", "configure"),
    "hookimpl": ("checkpointables.hookspecs", "hookimpl"),
    "is_checkpoint": ("checkpointables.layout", "is_checkpoint"),
    "CheckpointableHandler": ("checkpointables.protocols", "CheckpointableHandler"),
    "StatefulCheckpointable": ("checkpointables.protocols", "StatefulCheckpointable"),
    "save": ("checkpointables._pytree_api", "save_pytree"),
    "save_async": ("checkpointables._pytree_api", "save_pytree_async"),
    "load": ("checkpointables._pytree_api", "load_pytree"),
    "load_async": ("checkpointables._pytree_api", "load_pytree_async"),
    "metadata": ("checkpointables._pytree_api", "pytree_metadata"),
}


if not TYPE_CHECKING:  # Type checkers see the imports above, so a typo stays an error.
    __getattr__, __dir__ = first_use_attributes(__name__, _LAZY_NAMES, __all__)
