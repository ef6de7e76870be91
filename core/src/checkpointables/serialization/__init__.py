"""Pytree leaf handlers: the protocol, its parameters, and registries.

The pytree plugin saves a pytree leaf by leaf, handing each batch of leaves of
one type to a ``LeafHandler``. Plugins add leaf handlers with the
``register_leaf_handlers`` hook; users add them to a registry passed in
``PyTreeOptions(leaf_handler_registry=...)``.

Example::

    registry = cp.serialization.StandardLeafHandlerRegistry()
    registry.add(Point, AbstractPoint, PointLeafHandler)
    with cp.Context(pytree_options=cp.options.PyTreeOptions(leaf_handler_registry=registry)):
        cp.save_pytree(path, tree_with_points)
"""

from __future__ import annotations

from checkpointables.serialization._registry import (
    AlreadyRegisteredTypeError,
    LeafEntry,
    LeafHandlerRegistry,
    StandardLeafHandlerRegistry,
    UnregisteredTypeError,
)
from checkpointables.serialization._types import (
    AbstractArray,
    AbstractShardedArray,
    DeserializationContext,
    DeserializationParam,
    LeafHandler,
    SerializationContext,
    SerializationParam,
    param_name_from_keypath,
)

__all__ = [
    "LeafHandler",
    "LeafHandlerRegistry",
    "StandardLeafHandlerRegistry",
    "LeafEntry",
    "SerializationParam",
    "DeserializationParam",
    "SerializationContext",
    "DeserializationContext",
    "AbstractArray",
    "AbstractShardedArray",
    "AlreadyRegisteredTypeError",
    "UnregisteredTypeError",
    "param_name_from_keypath",
]
