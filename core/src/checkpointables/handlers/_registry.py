"""The handler registry: plugin registrations plus ``register_handler`` calls."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable
from typing import Any, TypeVar

from checkpointables import errors, plugins
from checkpointables.handlers._resolution import install_hint, refuse_contested
from checkpointables.protocols import typestr as handlers_typestr

H = TypeVar("H", bound=type)

_lock = threading.Lock()
_user_registrations: dict[type, plugins.HandlerRegistration] = {}


def register_handler(
    handler_cls: H,
    *,
    priority: int | None = None,
    name: str | None = None,
    checkpointable_name: str | None = None,
    secondary_typestrs: Iterable[str] = (),
    typestr: str | None = None,
) -> H:
    """Registers a handler class for this process; returns it (usable as a decorator).

    Args:
      handler_cls: a ``CheckpointableHandler`` class constructible with no arguments.
      priority: lower values are tried earlier when saving (default 50, ahead
        of the built-in JSON and pytree handlers).
      name: the short name ``cp.handlers.get`` finds it by; defaults to the
        class name, lower-cased, without a ``Handler`` suffix.
      checkpointable_name: if given, the handler is used for that
        checkpointable name only, ahead of resolution.
      secondary_typestrs: other typestrs (older names) this handler can load, as a list
        (a bare str is refused with ``cp.errors.InvalidArgumentTypeError``). A typestr
        that another handler also claims is read by neither: loads of it raise
        ``cp.errors.PluginError`` until one handler is forced for the checkpointable.
      typestr: what checkpoints record for this handler; defaults to the
        class's ``module.qualname``.

    Registering the same class again replaces its earlier registration, with
    a ``UserWarning`` if that changes its priority (two parts of a program
    disagreeing on it; ``unregister_handler`` first to change it on purpose).
    A name that a plugin also uses refers to this handler in ``get`` from now on.
    """
    registration = plugins.make_handler_registration(
        handler_cls,
        plugin=plugins.USER_PLUGIN,
        priority=priority,
        name=name,
        checkpointable_name=checkpointable_name,
        secondary_typestrs=secondary_typestrs,
        typestr=typestr,
    )
    with _lock:
        earlier = _user_registrations.get(handler_cls)
        _user_registrations[handler_cls] = registration
    if earlier is not None and earlier.priority != registration.priority:
        warnings.warn(
            f"cp.handlers.register_handler({handlers_typestr(handler_cls)}) was already called "
            f"with priority {earlier.priority}; this call replaces it with priority "
            f"{registration.priority}, which changes the order save resolution tries handlers in. "
            f"If that is meant, call cp.handlers.unregister_handler first; otherwise pass the "
            f"same priority.",
            UserWarning,
            stacklevel=2,
        )
    return handler_cls


def unregister_handler(handler_cls: type) -> None:
    """Removes a handler added by :func:`register_handler` (plugins are untouched)."""
    with _lock:
        _user_registrations.pop(handler_cls, None)


def registered_handlers() -> tuple[plugins.HandlerRegistration, ...]:
    """Every registered handler, in save-resolution order ``(priority, name)``."""
    with _lock:
        user = list(_user_registrations.values())
    user_classes = {r.handler_cls for r in user}
    from_plugins = [r for r in plugins.handler_registrations() if r.handler_cls not in user_classes]
    return tuple(sorted(from_plugins + user, key=lambda r: r.sort_key))


def get(name_or_typestr: Any) -> type:
    """Returns a registered handler class by short name, typestr or secondary typestr.

    A class is returned unchanged, so option values may be either.

    Example::

        cp.handlers.get("json")  # -> checkpointables_json.JsonHandler
    """
    if isinstance(name_or_typestr, type):
        return name_or_typestr
    if not isinstance(name_or_typestr, str):
        raise TypeError(
            f"cp.handlers.get takes a handler name, typestr or class, got {name_or_typestr!r}."
        )
    registrations = registered_handlers()
    # Handlers registered in this process shadow plugins' handlers of the same name.
    by_origin = sorted(registrations, key=lambda r: r.plugin != plugins.USER_PLUGIN)
    for r in by_origin:
        if r.name == name_or_typestr:
            return r.handler_cls
    for r in registrations:
        if r.matches_typestr(name_or_typestr):
            # Two handlers claiming the typestr: returning either would pick one silently.
            refuse_contested(registrations, name_or_typestr, name_or_typestr, "look up")
            return r.handler_cls
    known = ", ".join(sorted(r.name for r in registrations)) or "none"
    hint = install_hint(name_or_typestr)
    raise errors.MissingHandlerError(
        f"No handler named {name_or_typestr!r} is registered (registered: {known}).{hint}"
    )
