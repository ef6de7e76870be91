"""``Context``: the options in force for a save or load.

The innermost active ``with cp.Context(...)`` wins; options it does not set come
from the context that was active when it was created, and finally from the
global defaults that ``cp.configure`` changes. Background work keeps the
context that was active when it started.
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any

import attrs

from checkpointables import errors
from checkpointables import options as options_lib

__all__ = ["Context", "configure", "get_context"]

_OPTION_TYPES: dict[str, type] = {
    "async_options": options_lib.AsyncOptions,
    "multiprocessing_options": options_lib.MultiprocessingOptions,
    "file_options": options_lib.FileOptions,
    "pytree_options": options_lib.PyTreeOptions,
    "array_options": options_lib.ArrayOptions,
    "checkpointables_options": options_lib.CheckpointablesOptions,
    "storage_options": options_lib.StorageOptions,
}


def _check_options(values: dict[str, Any]) -> None:
    for key, value in values.items():
        if key not in _OPTION_TYPES:
            raise errors.InvalidArgumentTypeError(
                f"Unknown option {key!r}; expected one of {sorted(_OPTION_TYPES)}."
            )
        expected = _OPTION_TYPES[key]
        if value is not None and not isinstance(value, expected):
            raise errors.InvalidArgumentTypeError(
                f"Option {key} must be a cp.options.{expected.__name__}, "
                f"got {type(value).__name__}."
            )


@attrs.frozen
class _Defaults:
    async_options: options_lib.AsyncOptions = options_lib.AsyncOptions()
    multiprocessing_options: options_lib.MultiprocessingOptions = (
        options_lib.MultiprocessingOptions()
    )
    file_options: options_lib.FileOptions = options_lib.FileOptions()
    pytree_options: options_lib.PyTreeOptions = options_lib.PyTreeOptions()
    array_options: options_lib.ArrayOptions = options_lib.ArrayOptions()
    checkpointables_options: options_lib.CheckpointablesOptions = (
        options_lib.CheckpointablesOptions()
    )
    storage_options: options_lib.StorageOptions = options_lib.StorageOptions()


_defaults = _Defaults()
_defaults_lock = threading.Lock()
_active: contextvars.ContextVar[Context | None] = contextvars.ContextVar(
    "checkpointables_context", default=None
)


def configure(**options: Any) -> None:
    """Changes the global default options.

    Example::

        cp.configure(async_options=cp.options.AsyncOptions(timeout_secs=60))
    """
    global _defaults
    _check_options(options)
    with _defaults_lock:
        _defaults = attrs.evolve(_defaults, **{k: v for k, v in options.items() if v is not None})


class Context:
    """The options for every save and load inside its ``with`` block.

    Example::

        with cp.Context(pytree_options=cp.options.PyTreeOptions(partial_load=True)):
            cp.load_pytree(path, abstract_subset)
    """

    def __init__(self, context: Context | None = None, **options: Any) -> None:
        _check_options(options)
        self._parent = context if context is not None else _active.get()
        self._overrides = {k: v for k, v in options.items() if v is not None}
        # Per thread: one context may be entered by a caller and its background work at once.
        self._local = threading.local()

    def _get(self, name: str) -> Any:
        if name in self._overrides:
            return self._overrides[name]
        if self._parent is not None:
            return self._parent._get(name)
        return getattr(_defaults, name)

    @property
    def async_options(self) -> options_lib.AsyncOptions:
        """The ``AsyncOptions`` in force."""
        return self._get("async_options")

    @property
    def multiprocessing_options(self) -> options_lib.MultiprocessingOptions:
        """The ``MultiprocessingOptions`` in force."""
        return self._get("multiprocessing_options")

    @property
    def file_options(self) -> options_lib.FileOptions:
        """The ``FileOptions`` in force."""
        return self._get("file_options")

    @property
    def pytree_options(self) -> options_lib.PyTreeOptions:
        """The ``PyTreeOptions`` in force."""
        return self._get("pytree_options")

    @property
    def array_options(self) -> options_lib.ArrayOptions:
        """The ``ArrayOptions`` in force."""
        return self._get("array_options")

    @property
    def checkpointables_options(self) -> options_lib.CheckpointablesOptions:
        """The ``CheckpointablesOptions`` in force."""
        return self._get("checkpointables_options")

    @property
    def storage_options(self) -> options_lib.StorageOptions:
        """The ``StorageOptions`` in force (object stores)."""
        return self._get("storage_options")

    def replace(self, **options: Any) -> Context:
        """Returns a context with some options replaced (``self`` is unchanged)."""
        return Context(self, **options)

    def __enter__(self) -> Context:
        tokens = self._local.__dict__.setdefault("tokens", [])
        tokens.append(_active.set(self))
        return self

    def __exit__(self, *exc: object) -> None:
        _active.reset(self._local.tokens.pop())

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={self._get(k)!r}" for k in _OPTION_TYPES)
        return f"Context({shown})"


def get_context(context: Context | None = None) -> Context:
    """Returns ``context`` if given, else the innermost active one, else the defaults."""
    if context is not None:
        return context
    active = _active.get()
    return active if active is not None else Context()
