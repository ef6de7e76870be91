"""``Context``: the options in force for a save or load.

The innermost active ``with cp.Context(...)`` wins; options it does not set come
from the context that was active when it was created, and finally from the
global defaults that ``cp.configure`` changes. Background work keeps the
context that was active when it started.

Core's options are ``cp.options.BUILTIN``; plugins add theirs with the
``register_options`` hook (the pytree plugin: ``array_options``,
``storage_options``). A keyword core does not know makes plugins be
discovered before it is accepted or rejected.
"""

from __future__ import annotations

import contextvars
import threading
import warnings
from typing import Any, TypeVar

from checkpointables import errors, plugins
from checkpointables import options as options_lib

__all__ = ["Context", "configure", "get_context"]

T = TypeVar("T")

_BUILTIN_DEFAULTS: dict[str, Any] = {k: cls() for k, cls in options_lib.BUILTIN.items()}
# The plugins' option registrations by keyword, for one discovery (see ``_registered``).
_plugin_options: tuple[tuple[Any, ...], dict[str, plugins.OptionRegistration]] | None = None


def _registered() -> dict[str, plugins.OptionRegistration]:
    """The option classes plugins registered, by keyword (discovers plugins on first use)."""
    global _plugin_options
    registrations = plugins.option_registrations()
    cached = _plugin_options
    if cached is not None and cached[0] is registrations:
        return cached[1]
    found = {}
    for r in registrations:
        if r.keyword in options_lib.BUILTIN:
            warnings.warn(
                f"Plugin {r.plugin!r} registers the option keyword {r.keyword!r}, which is "
                f"core's; its {r.options_cls.__name__} is ignored. The plugin must register "
                f"another keyword.",
                RuntimeWarning,
                stacklevel=3,
            )
            continue
        found[r.keyword] = r
    _plugin_options = (registrations, found)
    return found


def _expected_type(key: str) -> tuple[type, str]:
    """The option class of keyword ``key`` and how to name it in messages."""
    builtin = options_lib.BUILTIN.get(key)
    if builtin is not None:
        return builtin, f"cp.options.{builtin.__name__}"
    registration = _registered().get(key)
    if registration is None:
        known = sorted([*options_lib.BUILTIN, *_registered()])
        raise errors.InvalidArgumentTypeError(
            f"Unknown option {key!r}; expected one of {known} (plugins add keywords: "
            f"`checkpointables plugins` lists them)."
        )
    cls = registration.options_cls
    return cls, f"{cls.__name__} (of plugin {registration.plugin!r})"


def _check_options(values: dict[str, Any]) -> None:
    for key, value in values.items():
        expected, name = _expected_type(key)
        if value is not None and not isinstance(value, expected):
            raise errors.InvalidArgumentTypeError(
                f"Option {key} must be a {name}, got {type(value).__name__}."
            )


def _default(key: str) -> Any:
    """What option ``key`` is when nothing set it."""
    if key in _BUILTIN_DEFAULTS:
        return _BUILTIN_DEFAULTS[key]
    registration = _registered().get(key)
    if registration is None:
        raise AttributeError(
            f"'Context' object has no attribute {key!r}: no option of that keyword is "
            f"registered (known: {sorted([*options_lib.BUILTIN, *_registered()])})."
        )
    return registration.default


# What ``cp.configure`` set, by keyword; the rest are the option classes' defaults.
_defaults: dict[str, Any] = {}
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
        _defaults = {**_defaults, **{k: v for k, v in options.items() if v is not None}}


class Context:
    """The options for every save and load inside its ``with`` block.

    Each option is read as ``context.<keyword>`` (``context.async_options``,
    and the keywords plugins register, e.g. ``context.storage_options``) or,
    typed, as ``context.options(OptionClass)``.

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
        found = _defaults.get(name)
        return found if found is not None else _default(name)

    def __getattr__(self, name: str) -> Any:
        """A plugin's option by its keyword, e.g. ``context.storage_options``."""
        if name.startswith("_"):  # Not an option (e.g. copy's probes before __init__ ran).
            raise AttributeError(name)
        return self._get(name)

    def options(self, options_cls: type[T]) -> T:
        """The option of class ``options_cls`` in force (typed), e.g.
        ``context.options(StorageOptions)``."""
        for key, cls in options_lib.BUILTIN.items():
            if cls is options_cls:
                return self._get(key)
        for key, registration in _registered().items():
            if registration.options_cls is options_cls:
                return self._get(key)
        raise errors.InvalidArgumentTypeError(
            f"{options_cls!r} is not an option class of cp.Context: core's are "
            f"{sorted(c.__name__ for c in options_lib.BUILTIN.values())}, plugins add theirs "
            f"with the register_options hook."
        )

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
    def checkpointables_options(self) -> options_lib.CheckpointablesOptions:
        """The ``CheckpointablesOptions`` in force."""
        return self._get("checkpointables_options")

    @property
    def memory_options(self) -> options_lib.MemoryOptions:
        """The ``MemoryOptions`` in force (``host_bytes=None``: no bound)."""
        return self._get("memory_options")

    def replace(self, **options: Any) -> Context:
        """Returns a context with some options replaced (``self`` is unchanged)."""
        return Context(self, **options)

    def __enter__(self) -> Context:
        tokens = self._local.__dict__.setdefault("tokens", [])
        tokens.append(_active.set(self))
        return self

    def __exit__(self, *exc: object) -> None:
        _active.reset(self._local.tokens.pop())

    def _keywords(self) -> list[str]:
        """Core's keywords, then every other keyword set here, above, or by ``configure``."""
        found = dict.fromkeys(options_lib.BUILTIN)
        context: Context | None = self
        while context is not None:
            found.update(dict.fromkeys(context._overrides))
            context = context._parent
        found.update(dict.fromkeys(_defaults))
        return list(found)

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={self._get(k)!r}" for k in self._keywords())
        return f"Context({shown})"


def get_context(context: Context | None = None) -> Context:
    """Returns ``context`` if given, else the innermost active one, else the defaults."""
    if context is not None:
        return context
    active = _active.get()
    return active if active is not None else Context()
