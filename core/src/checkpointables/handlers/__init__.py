"""Checkpointable handlers: registration, lookup and resolution.

Handlers arrive from plugins (entry points in the group ``checkpointables``)
or from :func:`register_handler`. Saving tries them by ``(priority, name)`` and
takes the first whose ``is_handleable`` accepts the object; loading uses the
typestr recorded in the checkpoint.

Example::

    cp.handlers.register_handler(PointHandler)
    json_handler = cp.handlers.get("json")
"""

from __future__ import annotations

from checkpointables.handlers._registry import (
    get,
    register_handler,
    registered_handlers,
    unregister_handler,
)
from checkpointables.handlers._resolution import (
    handlers_accepting,
    install_hint,
    resolve_for_load,
    resolve_for_save,
    unavailable_plugin,
)
from checkpointables.plugins import HandlerRegistration
from checkpointables.protocols import CheckpointableHandler, StatefulCheckpointable, typestr

__all__ = [
    "CheckpointableHandler",
    "StatefulCheckpointable",
    "HandlerRegistration",
    "register_handler",
    "unregister_handler",
    "registered_handlers",
    "get",
    "typestr",
    "resolve_for_save",
    "resolve_for_load",
    "install_hint",
    "unavailable_plugin",
    "handlers_accepting",
]
