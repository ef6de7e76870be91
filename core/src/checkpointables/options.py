"""Option classes: frozen attrs classes, set through ``cp.Context`` or ``cp.configure``.

Example::

    import checkpointables as cp

    with cp.Context(async_options=cp.options.AsyncOptions(timeout_secs=60)):
        cp.save_pytree(path, state)

Core defines the options core reads (``BUILTIN``). Settings only a plugin
reads are the plugin's own classes, added through the ``register_options``
hook; they are found here by name too: ``cp.options.ArrayOptions``,
``cp.options.ArrayStorageOptions`` and ``cp.options.StorageOptions`` are the
pytree plugin's (TensorStore and S3 settings), looked up when first used.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from checkpointables import plugins

__all__ = [
    "AsyncOptions",
    "MultiprocessingOptions",
    "FileOptions",
    "PyTreeOptions",
    "CheckpointablesOptions",
    "BUILTIN",
]


def _frozenset_or_none(value: Any) -> frozenset[int] | None:
    return None if value is None else frozenset(value)


@attrs.frozen
class AsyncOptions:
    """How background work is bounded.

    Attributes:
      timeout_secs: the longest any wait on background work or on other
        processes may last before it fails with a ``TimeoutError`` that says
        what was being waited for.
    """

    timeout_secs: float = attrs.field(default=1200, validator=attrs.validators.gt(0))


@attrs.frozen
class MultiprocessingOptions:
    """Which processes take part in a save and which one commits it.

    Attributes:
      primary_host: the process index that writes metadata and commits. ``None``
        means every process acts as its own primary (process-local storage).
      active_processes: the process indices taking part; ``None`` means all.
      barrier_sync_key_prefix: a prefix for the keys of cross-process barriers,
        so that several independent checkpointers may run in one job.
    """

    primary_host: int | None = 0
    active_processes: frozenset[int] | None = attrs.field(
        default=None, converter=_frozenset_or_none
    )
    barrier_sync_key_prefix: str | None = None


@attrs.frozen
class FileOptions:
    """How files and directories are created.

    Attributes:
      path_permission_mode: permission bits for directories the library
        creates (e.g. ``0o750``); ``None`` keeps the process umask.
    """

    path_permission_mode: int | None = None


@attrs.frozen
class PyTreeOptions:
    """Options for pytree checkpointables.

    Attributes:
      leaf_handler_registry: the leaf handlers to use; ``None`` means a
        ``cp.serialization.StandardLeafHandlerRegistry()`` holding every leaf
        handler that plugins registered.
      partial_load: allow an abstract tree that omits keys of the stored tree.
    """

    leaf_handler_registry: Any = None
    partial_load: bool = False


def _handler_map(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return dict(value or {})


@attrs.frozen
class CheckpointablesOptions:
    """Which handler to use for which checkpointable name.

    Attributes:
      handlers: maps a checkpointable name to a handler class, or to the name
        or typestr of a registered handler. Those names skip resolution.
    """

    handlers: Mapping[str, Any] = attrs.field(factory=dict, converter=_handler_map)

    @classmethod
    def create_with_handlers(cls, **handlers: Any) -> CheckpointablesOptions:
        """Forces a handler per checkpointable name.

        Example::

            cp.options.CheckpointablesOptions.create_with_handlers(extra=cp.handlers.get("json"))
        """
        return cls(handlers=handlers)


BUILTIN: dict[str, type] = {
    "async_options": AsyncOptions,
    "multiprocessing_options": MultiprocessingOptions,
    "file_options": FileOptions,
    "pytree_options": PyTreeOptions,
    "checkpointables_options": CheckpointablesOptions,
}
"""Core's option classes by keyword of ``cp.Context`` / ``cp.configure``; plugins add theirs."""


def __getattr__(name: str) -> type:
    """An option class a plugin registered, by class name (e.g. ``StorageOptions``)."""
    if name.startswith("__"):  # Probes such as __path__ or __wrapped__ are not option classes.
        raise AttributeError(name)
    for registration in plugins.option_registrations():
        for cls in (registration.options_cls, *registration.parts):
            if cls.__name__ == name:
                return cls
    raise AttributeError(
        f"module 'checkpointables.options' has no attribute {name!r}: neither core nor any "
        f"installed plugin registers an option class of that name (`checkpointables plugins` "
        f"lists the plugins' options; ArrayOptions, ArrayStorageOptions and StorageOptions need "
        f"the pytree plugin: pip install checkpointables-pytree)."
    )
