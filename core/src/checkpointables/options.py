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

from checkpointables import errors, plugins

__all__ = [
    "AsyncOptions",
    "MultiprocessingOptions",
    "FileOptions",
    "PyTreeOptions",
    "CheckpointablesOptions",
    "MemoryOptions",
    "MIN_HOST_BYTES",
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


# The smallest host-memory budget: a budget is cut into pieces of an eighth of it (several
# in flight, each copied once by the storage layer), and a piece is at least 1 MiB.
MIN_HOST_BYTES = 8 << 20


def _check_host_bytes(instance: Any, attribute: Any, value: int | None) -> None:
    """``host_bytes`` is ``None`` or an int of at least ``MIN_HOST_BYTES``."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise errors.InvalidArgumentTypeError(
            f"MemoryOptions.host_bytes must be an int (bytes) or None, got "
            f"{type(value).__name__} {value!r}."
        )
    if value < MIN_HOST_BYTES:
        raise errors.InvalidArgumentError(
            f"MemoryOptions.host_bytes={value} is too small: the smallest workable budget is "
            f"{MIN_HOST_BYTES} bytes ({MIN_HOST_BYTES >> 20} MiB; a save or load moves arrays "
            f"in pieces of an eighth of the budget, at least 1 MiB each). Pass at least "
            f"{MIN_HOST_BYTES}, or None for no bound."
        )


@attrs.frozen
class MemoryOptions:
    """How much host memory a save or load of pytrees may use for staging.

    Example::

        with cp.Context(memory_options=cp.options.MemoryOptions(host_bytes=8 << 30)):
            cp.save_pytree(path, state)     # device-to-host copies and writes stream
            state = cp.load_pytree(path, abstract_state)  # reads stream onto the devices

    Attributes:
      host_bytes: the most bytes of host memory the library holds at once for
        copies from the devices, encoding, reading and decoding of arrays
        (what the state itself occupies, e.g. on CPU devices, is not counted).
        ``None`` (the default): no bound, every array is staged at once (the
        fastest). At least ``MIN_HOST_BYTES`` (8 MiB), else
        ``cp.errors.InvalidArgumentError``. See docs/memory.md.
    """

    host_bytes: int | None = attrs.field(default=None, validator=_check_host_bytes)


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
    "memory_options": MemoryOptions,
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
