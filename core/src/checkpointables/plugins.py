"""Plugin discovery: entry points in the group ``checkpointables``, through pluggy.

Discovery is lazy (the first save, load or listing triggers it, never
``import checkpointables``), cached, and refreshed by :func:`refresh`. A plugin
that fails to import or to register is skipped with a ``RuntimeWarning`` and
shows in :func:`list_plugins` with its error; the others keep working.
``CHECKPOINTABLES_DISABLE_PLUGINS=a,b`` blocks plugins by entry-point name.
A handler name two plugins register is settled over all plugins at once: ours
(``PROJECT_DISTRIBUTIONS``) keep theirs, and third parties sharing one are all
skipped (docs/handler-resolution.md, "Handler names").
"""

from __future__ import annotations

import os
import re
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import attrs
import importlib_metadata
import pluggy

from checkpointables import errors, hookspecs
from checkpointables.protocols import CheckpointableHandler, PyTreeReader, missing_methods
from checkpointables.protocols import typestr as typestr_of

__all__ = [
    "canonical_distribution",
    "ENTRY_POINT_GROUP",
    "DISABLE_ENV_VAR",
    "PROJECT_DISTRIBUTIONS",
    "HandlerRegistration",
    "LeafRegistration",
    "ReaderRegistration",
    "CommandRegistration",
    "PluginInfo",
    "list_plugins",
    "refresh",
    "handler_registrations",
    "leaf_registrations",
    "reader_registrations",
    "command_registrations",
    "StorageRegistration",
    "storage_factories",
    "OptionRegistration",
    "option_registrations",
]

ENTRY_POINT_GROUP = "checkpointables"
DISABLE_ENV_VAR = "CHECKPOINTABLES_DISABLE_PLUGINS"
DEFAULT_PRIORITY = 50
USER_PLUGIN = "<register_handler>"
# The distributions this repository ships. Their plugins keep the handler names they
# register: a third-party plugin registering one of those names is the one refused,
# whatever the order entry points come in (docs/handler-resolution.md, "Handler names").
PROJECT_DISTRIBUTIONS = frozenset(
    {
        "checkpointables-core",
        "checkpointables-pytree",
        "checkpointables-json",
        "checkpointables-proto",
        "checkpointables-grain",
        "checkpointables-safetensors",
    }
)


@attrs.frozen
class HandlerRegistration:
    """One checkpointable handler as registered, with where it came from."""

    handler_cls: type
    name: str
    priority: int
    typestr: str
    secondary_typestrs: tuple[str, ...]
    checkpointable_name: str | None
    plugin: str
    # The distribution (name, version) that installed the plugin; recorded in checkpoints
    # so that a load without the plugin can say what to install. None for register_handler.
    distribution: str | None = None
    version: str | None = None

    @property
    def sort_key(self) -> tuple[int, str]:
        """Save resolution tries handlers in this order."""
        return (self.priority, self.name)

    def matches_typestr(self, recorded: str) -> bool:
        """Whether this handler wrote, or can read, data recorded as ``recorded``."""
        return recorded == self.typestr or recorded in self.secondary_typestrs


@attrs.frozen
class LeafRegistration:
    """One pytree leaf handler as registered by a plugin."""

    leaf_type: type
    abstract_type: Any
    handler_cls: type
    secondary_typestrs: tuple[str, ...]
    plugin: str


@attrs.frozen
class ReaderRegistration:
    """One pytree reader (``register_pytree_readers``) as registered by a plugin."""

    reader_cls: type
    name: str
    priority: int
    plugin: str

    @property
    def sort_key(self) -> tuple[int, str]:
        """Readers are asked in this order whether they recognize a path."""
        return (self.priority, self.name)


@attrs.frozen
class CommandRegistration:
    """One subcommand of ``checkpointables`` (``register_commands``) as registered by a plugin."""

    name: str
    run: Callable[[Any], int]
    help: str
    add_arguments: Callable[[Any], None] | None
    plugin: str


@attrs.frozen
class StorageRegistration:
    """A storage backend for one URL scheme (``register_storage``), as registered by a plugin."""

    scheme: str
    factory: Callable[..., Any]
    plugin: str


@attrs.frozen
class OptionRegistration:
    """An option class a plugin adds to ``cp.Context`` (``register_options``), under a keyword."""

    keyword: str
    options_cls: type
    default: Any  # ``options_cls()``: in force until a context or ``cp.configure`` sets one.
    plugin: str
    # Classes the option class's fields take (e.g. ``ArrayStorageOptions``), also offered
    # as ``cp.options.<name>``.
    parts: tuple[type, ...] = ()


@attrs.frozen
class PluginInfo:
    """What :func:`list_plugins` reports about one entry point."""

    name: str
    value: str
    distribution: str | None
    version: str | None
    status: Literal["loaded", "disabled", "failed"]
    error: str | None
    handlers: tuple[HandlerRegistration, ...]
    leaf_handlers: tuple[LeafRegistration, ...]
    readers: tuple[ReaderRegistration, ...] = ()
    commands: tuple[CommandRegistration, ...] = ()
    storages: tuple[StorageRegistration, ...] = ()
    options: tuple[OptionRegistration, ...] = ()


def sentence(text: str) -> str:
    """``text`` ending with a full stop, added only where it has none (messages that quote
    an error, itself a sentence, must not end with two)."""
    text = text.rstrip()
    return text if text.endswith((".", "!", "?")) else f"{text}."


def _default_handler_name(handler_cls: type) -> str:
    name = handler_cls.__name__
    if name.endswith("Handler") and len(name) > len("Handler"):
        name = name[: -len("Handler")]
    return name.lower()


def typestr_tuple(value: Iterable[str], what: str) -> tuple[str, ...]:
    """``value`` (``secondary_typestrs=``) as a tuple of non-empty strs; a bare str, whose
    characters would each become a typestr, is refused."""
    if isinstance(value, (str, bytes)):
        raise errors.InvalidArgumentTypeError(
            f"{what} takes a list of typestrs, got the str {value!r}: pass [{value!r}]."
        )
    typestrs = tuple(value)
    if not all(isinstance(t, str) and t for t in typestrs):
        raise errors.InvalidArgumentTypeError(
            f"{what} takes non-empty strs (typestrs like 'module.QualName'), got {typestrs!r}."
        )
    return typestrs


def contested_typestrs(
    registrations: Iterable[HandlerRegistration],
) -> dict[str, tuple[HandlerRegistration, ...]]:
    """Each typestr that handlers of more than one class claim (as their typestr or a
    secondary one), with those handlers' registrations, sorted by plugin then name.

    Such a typestr is read by none of them unless the user forces one: which of two
    plugins wrote a checkpoint cannot be told, and data one plugin wrote must never be
    read by another silently (docs/handler-resolution.md, "Typestr clashes").
    """
    claims: dict[str, dict[type, HandlerRegistration]] = {}
    for r in registrations:
        for claimed in (r.typestr, *r.secondary_typestrs):
            claims.setdefault(claimed, {}).setdefault(r.handler_cls, r)
    return {
        claimed: tuple(sorted(by_cls.values(), key=lambda r: (r.plugin, r.name)))
        for claimed, by_cls in sorted(claims.items())
        if len(by_cls) > 1
    }


def describe_claimant(r: HandlerRegistration) -> str:
    """``r`` as a clash names it: handler, class, and where it came from."""
    origin = (
        "registered with cp.handlers.register_handler"
        if r.plugin == USER_PLUGIN
        else f"of plugin {r.plugin!r}"
    )
    return f"handler {r.name!r} ({typestr_of(r.handler_cls)}) {origin}"


def make_handler_registration(
    handler_cls: type,
    *,
    plugin: str,
    priority: int | None = None,
    name: str | None = None,
    checkpointable_name: str | None = None,
    secondary_typestrs: Iterable[str] = (),
    typestr: str | None = None,
) -> HandlerRegistration:
    """Validates a ``register(...)`` call and builds its registration."""
    if not isinstance(handler_cls, type):
        raise TypeError(
            f"register() takes a handler class, got {handler_cls!r} "
            f"({type(handler_cls).__name__}); pass the class, not an instance."
        )
    if not issubclass(handler_cls, CheckpointableHandler):
        missing = missing_methods(handler_cls, CheckpointableHandler)
        raise TypeError(
            f"{typestr_of(handler_cls)} is not a CheckpointableHandler: it lacks {missing}."
        )
    if priority is not None and not isinstance(priority, int):
        raise TypeError(f"priority must be an int, got {priority!r}.")
    if typestr is not None and not (isinstance(typestr, str) and typestr):
        raise TypeError(f"typestr must be a non-empty str, got {typestr!r}.")
    return HandlerRegistration(
        handler_cls=handler_cls,
        name=name or _default_handler_name(handler_cls),
        priority=DEFAULT_PRIORITY if priority is None else priority,
        typestr=typestr or typestr_of(handler_cls),
        secondary_typestrs=typestr_tuple(secondary_typestrs, "secondary_typestrs="),
        checkpointable_name=checkpointable_name,
        plugin=plugin,
    )


def make_reader_registration(
    reader_cls: type, *, plugin: str, priority: int | None = None, name: str | None = None
) -> ReaderRegistration:
    """Validates a ``register(...)`` call of ``register_pytree_readers``."""
    if not isinstance(reader_cls, type):
        raise TypeError(f"register() takes a reader class, got {reader_cls!r}.")
    if not issubclass(reader_cls, PyTreeReader):
        missing = missing_methods(reader_cls, PyTreeReader)
        raise TypeError(f"{typestr_of(reader_cls)} is not a PyTreeReader: it lacks {missing}.")
    if priority is not None and not isinstance(priority, int):
        raise TypeError(f"priority must be an int, got {priority!r}.")
    default_name = reader_cls.__name__.removesuffix("Reader").lower() or reader_cls.__name__
    return ReaderRegistration(
        reader_cls=reader_cls,
        name=name or default_name,
        priority=DEFAULT_PRIORITY if priority is None else priority,
        plugin=plugin,
    )


def make_command_registration(
    name: str,
    run: Callable[[Any], int],
    *,
    plugin: str,
    help: str = "",
    add_arguments: Callable[[Any], None] | None = None,
) -> CommandRegistration:
    """Validates a ``register(...)`` call of ``register_commands``."""
    if not isinstance(name, str) or not name or name.startswith("-") or " " in name:
        raise TypeError(f"A command name is a non-empty word, got {name!r}.")
    if not callable(run) or (add_arguments is not None and not callable(add_arguments)):
        raise TypeError(f"Command {name!r}: run and add_arguments must be callables.")
    return CommandRegistration(name, run, help, add_arguments, plugin)


def make_option_registration(
    keyword: str, options_cls: type, *, plugin: str, parts: Iterable[type] = ()
) -> OptionRegistration:
    """Validates a ``register(...)`` call of ``register_options``."""
    if not (isinstance(keyword, str) and keyword.isidentifier() and keyword.endswith("_options")):
        raise TypeError(
            f"register_options' register() takes a keyword like 'tracing_options' (an "
            f"identifier ending in _options), got {keyword!r}."
        )
    parts = tuple(parts)
    if not all(isinstance(c, type) for c in (options_cls, *parts)):
        raise TypeError(
            f"register_options' register() takes an option class (and classes as parts), got "
            f"{options_cls!r} and {parts!r}; pass the classes, not instances."
        )
    try:
        default = options_cls()
    except Exception as e:
        raise TypeError(
            f"Option class {typestr_of(options_cls)} ({keyword}) must be constructible with no "
            f"arguments (its defaults are the defaults): {e}"
        ) from e
    return OptionRegistration(keyword, options_cls, default, plugin, parts)


def _disabled_names() -> set[str]:
    raw = os.environ.get(DISABLE_ENV_VAR, "")
    return {part.strip() for part in raw.split(",") if part.strip()}


@attrs.frozen
class _Discovery:
    plugins: tuple[PluginInfo, ...]
    handlers: tuple[HandlerRegistration, ...]
    leaves: tuple[LeafRegistration, ...]
    readers: tuple[ReaderRegistration, ...] = ()
    commands: tuple[CommandRegistration, ...] = ()
    storages: tuple[StorageRegistration, ...] = ()
    options: tuple[OptionRegistration, ...] = ()


@attrs.define
class _Registered:
    """What one plugin registered through each hook."""

    handlers: list[HandlerRegistration] = attrs.Factory(list)
    leaves: list[LeafRegistration] = attrs.Factory(list)
    readers: list[ReaderRegistration] = attrs.Factory(list)
    commands: list[CommandRegistration] = attrs.Factory(list)
    storages: list[StorageRegistration] = attrs.Factory(list)
    options: list[OptionRegistration] = attrs.Factory(list)
    # Where the plugin's register_checkpointable_handlers is (file, line): what a warning
    # refusing one of its handler names points at.
    handler_hook: tuple[str, int] | None = None
    distribution: str | None = None  # The plugin's distribution (its option keywords').

    def extend(self, other: _Registered) -> None:
        """Adds what ``other`` registered to this."""
        self.handlers += other.handlers
        self.leaves += other.leaves
        self.readers += other.readers
        self.commands += other.commands
        self.storages += other.storages
        self.options += other.options


def _entry_points() -> list[importlib_metadata.EntryPoint]:
    seen: dict[tuple[str, str], importlib_metadata.EntryPoint] = {}
    for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        seen.setdefault((ep.name, ep.value), ep)
    # Sorted by name so that discovery never depends on sys.path order.
    return sorted(seen.values(), key=lambda ep: (ep.name, ep.value))


def _short_error(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()


def _collect(hook_function: Callable[..., Any], make: Callable[..., Any]) -> list[Any]:
    """Calls one plugin's hook with a ``register`` callback; returns what it registered."""
    collected: list[Any] = []

    def register(*args: Any, **kwargs: Any) -> Any:
        collected.append(make(*args, **kwargs))
        return args[0] if args else None

    hook_function(register=register)
    return collected


def _sort_handlers(registrations: Iterable[HandlerRegistration]) -> tuple[HandlerRegistration, ...]:
    return tuple(sorted(registrations, key=lambda r: r.sort_key))


def canonical_distribution(name: str) -> str:
    """A distribution's name as pip compares names (PEP 503: ``Foo_Bar.baz`` -> ``foo-bar-baz``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_project_distribution(distribution: str | None) -> bool:
    """Whether ``distribution`` is one this repository ships (``PROJECT_DISTRIBUTIONS``)."""
    if distribution is None:
        return False
    return canonical_distribution(distribution) in PROJECT_DISTRIBUTIONS


# What a claim's name is, for each kind of claim (how a message says it), and how a plugin
# avoids the clash.
_CLAIM_WORDS: dict[str, tuple[str, str, str]] = {
    "handler": ("under the name", "names", "register(..., name='...')"),
    "option class": ("under the keyword", "keywords", "register('...', ...)"),
    "leaf handler": ("for the leaf type", "leaf types", "register leaf handlers of its own types"),
    "storage backend": ("for the URL scheme", "URL schemes", "register another scheme"),
    "reader": ("under the name", "names", "register(..., name='...')"),
}


@attrs.frozen
class _Claim:
    """One plugin's claim on a name that only one class (or factory) may hold: a handler
    name, an option keyword, a leaf type, a storage URL scheme."""

    kind: str  # A key of ``_CLAIM_WORDS``.
    name: str
    cls: Any  # What holds the name: a class, or a storage factory.
    plugin: str
    distribution: str | None
    # What two claims must share not to clash (``cls``, or a leaf handler's whole
    # registration: its abstract type and typestrs decide what it writes and reads).
    identity: Any = None

    @property
    def held_by(self) -> Any:
        return self.cls if self.identity is None else self.identity

    @property
    def label(self) -> str:
        return _CLAIM_WORDS[self.kind][0]

    @property
    def plural(self) -> str:
        return _CLAIM_WORDS[self.kind][1]

    @property
    def rename(self) -> str:
        return _CLAIM_WORDS[self.kind][2]

    @property
    def origin(self) -> str:
        return f"plugin {self.plugin!r} ({self.distribution or 'no distribution'})"


def _claims(registered: _Registered) -> list[_Claim]:
    dist = registered.distribution
    return [
        *(_Claim("handler", r.name, r.handler_cls, r.plugin, dist) for r in registered.handlers),
        *(
            _Claim("option class", o.keyword, o.options_cls, o.plugin, dist)
            for o in registered.options
        ),
        *(
            _Claim(
                "leaf handler",
                typestr_of(r.leaf_type),
                r.handler_cls,
                r.plugin,
                dist,
                (r.handler_cls, r.abstract_type, r.secondary_typestrs),
            )
            for r in registered.leaves
        ),
        *(
            _Claim("storage backend", r.scheme, r.factory, r.plugin, dist)
            for r in registered.storages
        ),
        *(_Claim("reader", r.name, r.reader_cls, r.plugin, dist) for r in registered.readers),
    ]


def _name_refusals(loaded: dict[int, _Registered]) -> dict[int, str]:
    """Which loaded plugins (by index in ``loaded``) are refused for a handler name, an
    option keyword, a leaf type, a storage URL scheme or a reader name another plugin
    registers differently, with why. A function of the
    registrations alone, never of the order the plugins came in:

    - a name a plugin of ours (``PROJECT_DISTRIBUTIONS``) registers stays ours: every other
      plugin registering it is refused;
    - a name that plugins not of ours, and only they, register for different classes is
      given to none of them: each is refused (which one the user meant cannot be told).
    """
    claims: dict[tuple[str, str], dict[int, _Claim]] = {}
    for index, registered in loaded.items():
        for c in _claims(registered):
            claims.setdefault((c.kind, c.name), {}).setdefault(index, c)
    refused: dict[int, str] = {}
    for _, by_plugin in sorted(claims.items()):
        ours = [c for c in by_plugin.values() if is_project_distribution(c.distribution)]
        for index, c in by_plugin.items():
            if ours and c.held_by != ours[0].held_by:
                refused.setdefault(index, _taken_from_us(c, ours[0]))
    taken_from_us = set(refused)  # Those refused already do not keep others from a name.
    for _, by_plugin in sorted(claims.items()):
        left = {i: c for i, c in by_plugin.items() if i not in taken_from_us}
        if len({c.held_by for c in left.values()}) < 2:
            continue
        for index, c in left.items():
            others = [o for o in left.values() if o.held_by != c.held_by]
            refused.setdefault(index, _shared_name(c, others))
    return refused


def _taken_from_us(c: _Claim, ours: _Claim) -> str:
    return (
        f"it registers its {c.kind} {_named(c.cls)} {c.label} {c.name!r}, which belongs to "
        f"{_named(ours.cls)} of checkpointables' own {ours.origin}; our plugins keep their "
        f"{c.kind} {c.plural} whatever the order plugins load in. The plugin must "
        f"{c.rename} instead: tell the authors of {c.distribution or c.plugin!r}; until then "
        f"uninstall it, or set {DISABLE_ENV_VAR}={c.plugin} to skip it silently"
    )


def _shared_name(c: _Claim, others: Sequence[_Claim]) -> str:
    named = " and ".join(f"{_named(o.cls)} of {o.origin}" for o in others)
    blocked = ",".join(dict.fromkeys(o.plugin for o in others))
    return (
        f"it registers its {c.kind} {_named(c.cls)} {c.label} {c.name!r}, which {named} "
        f"registers too; which one you mean cannot be told, so every plugin registering it "
        f"is skipped. Keep one: to keep this one, uninstall the other or set "
        f"{DISABLE_ENV_VAR}={blocked}; to keep the other, {DISABLE_ENV_VAR}={c.plugin}. And "
        f"tell the authors to {c.rename}"
    )


def _named(obj: Any) -> str:
    """A class or factory function as ``module.qualname`` (any other callable: its repr)."""
    if isinstance(obj, type):
        return typestr_of(obj)
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{name}" if isinstance(module, str) and isinstance(name, str) else repr(obj)


def _load_plugin(ep: importlib_metadata.EntryPoint, manager: pluggy.PluginManager) -> _Registered:
    """Imports one plugin and calls its hooks; raises if anything about it is wrong."""
    manager.register(ep.load(), name=ep.name)
    distribution, version = distribution_of(ep)
    registered = _Registered(distribution=distribution)

    def make_handler(cls: type, **kwargs: Any) -> HandlerRegistration:
        registration = make_handler_registration(cls, plugin=ep.name, **kwargs)
        return attrs.evolve(registration, distribution=distribution, version=version)

    def make_leaf(
        leaf_type: type,
        abstract_type: Any,
        handler_cls: type,
        secondary_typestrs: Iterable[str] = (),
    ) -> LeafRegistration:
        typestrs = typestr_tuple(secondary_typestrs, "register_leaf_handlers' secondary_typestrs")
        return LeafRegistration(leaf_type, abstract_type, handler_cls, typestrs, ep.name)

    def make_reader(cls: type, **kwargs: Any) -> ReaderRegistration:
        return make_reader_registration(cls, plugin=ep.name, **kwargs)

    def make_command(name: str, run: Callable[[Any], int], **kwargs: Any) -> CommandRegistration:
        return make_command_registration(name, run, plugin=ep.name, **kwargs)

    def make_storage(scheme: str, factory: Callable[..., Any]) -> StorageRegistration:
        if not isinstance(scheme, str) or not scheme.isidentifier() or not callable(factory):
            raise TypeError(
                f"register_storage's register() takes a scheme like 's3' and a factory "
                f"callable, got {scheme!r} and {factory!r}"
            )
        return StorageRegistration(scheme, factory, ep.name)

    def make_options(keyword: str, options_cls: type, **kwargs: Any) -> OptionRegistration:
        return make_option_registration(keyword, options_cls, plugin=ep.name, **kwargs)

    hooks: list[tuple[Any, Callable[..., Any], list[Any]]] = [
        (manager.hook.register_checkpointable_handlers, make_handler, registered.handlers),
        (manager.hook.register_leaf_handlers, make_leaf, registered.leaves),
        (manager.hook.register_pytree_readers, make_reader, registered.readers),
        (manager.hook.register_commands, make_command, registered.commands),
        (manager.hook.register_storage, make_storage, registered.storages),
        (manager.hook.register_options, make_options, registered.options),
    ]
    for hook, make, into in hooks:
        for impl in hook.get_hookimpls():
            if impl.plugin_name == ep.name:
                into += _collect(impl.function, make)
                if make is make_handler:
                    code = impl.function.__code__
                    registered.handler_hook = (code.co_filename, code.co_firstlineno)
    return registered


def distribution_of(ep: importlib_metadata.EntryPoint) -> tuple[str | None, str | None]:
    """The name and version of the distribution that installed entry point ``ep``."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    return dist.metadata["Name"], dist.version


def _plugin_info(
    ep: importlib_metadata.EntryPoint,
    status: Literal["loaded", "disabled", "failed"],
    error: str | None = None,
    registered: _Registered | None = None,
) -> PluginInfo:
    distribution, version = distribution_of(ep)
    return PluginInfo(
        name=ep.name,
        value=ep.value,
        distribution=distribution,
        version=version,
        status=status,
        error=error,
        handlers=_sort_handlers(registered.handlers if registered else ()),
        leaf_handlers=tuple(registered.leaves if registered else ()),
        readers=tuple(registered.readers if registered else ()),
        commands=tuple(registered.commands if registered else ()),
        storages=tuple(registered.storages if registered else ()),
        options=tuple(registered.options if registered else ()),
    )


def discover(
    entry_points: Sequence[importlib_metadata.EntryPoint] | None = None,
    disabled: set[str] | None = None,
) -> _Discovery:
    """Loads every plugin and collects its registrations. Pure apart from imports.

    ``entry_points`` and ``disabled`` default to the installed entry points and
    the environment variable; tests may pass their own.
    """
    eps = _entry_points() if entry_points is None else list(entry_points)
    outcomes = _load_all(eps, _disabled_names() if disabled is None else disabled)
    loaded = {i: o for i, o in enumerate(outcomes) if isinstance(o, _Registered)}
    refused = _name_refusals(loaded)
    infos: list[PluginInfo] = []
    everything = _Registered()
    for index, (ep, outcome) in enumerate(zip(eps, outcomes, strict=True)):
        if index in refused:
            _warn_plugin(ep, f"is skipped: {sentence(refused[index])}", None, outcome)
            infos.append(_plugin_info(ep, "failed", refused[index]))
        elif isinstance(outcome, _Registered):
            everything.extend(outcome)
            infos.append(_plugin_info(ep, "loaded", None, outcome))
        else:
            infos.append(_plugin_info(ep, *outcome))
    _warn_contested(everything.handlers)
    return _Discovery(
        plugins=tuple(infos),
        handlers=_sort_handlers(everything.handlers),
        leaves=tuple(everything.leaves),
        readers=tuple(sorted(everything.readers, key=lambda r: r.sort_key)),
        commands=tuple(everything.commands),
        storages=tuple(everything.storages),
        options=tuple(everything.options),
    )


def _load_all(
    eps: Sequence[importlib_metadata.EntryPoint], disabled: set[str]
) -> list[_Registered | tuple[Literal["disabled", "failed"], str]]:
    """Each plugin's registrations, or why it has none (its status and error); a plugin that
    fails is warned of. Handler names are checked after, over all plugins at once."""
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    outcomes: list[_Registered | tuple[Literal["disabled", "failed"], str]] = []
    for ep in eps:
        if ep.name in disabled:
            outcomes.append(("disabled", f"disabled by {DISABLE_ENV_VAR}"))
            continue
        try:
            registered = _load_plugin(ep, manager)
        except Exception as e:  # A broken plugin must not break the others.
            if manager.get_plugin(ep.name) is not None:
                manager.unregister(name=ep.name)
            message = _short_error(e)
            _warn_plugin(
                ep,
                f"failed to load and is skipped: {sentence(message)} Reinstall or fix it, or "
                f"set {DISABLE_ENV_VAR}={ep.name} to silence this.",
                e,
                None,
            )
            outcomes.append(("failed", message))
            continue
        outcomes.append(registered)
    return outcomes


def _warn_plugin(
    ep: importlib_metadata.EntryPoint,
    what: str,
    error: BaseException | None,
    registered: object,
) -> None:
    """Warns that plugin ``ep`` ``what`` (e.g. "is skipped: ..."), at the plugin's own code
    rather than at ours, so that the warning (and a filter by module) names the plugin."""
    distribution, _ = distribution_of(ep)
    filename, lineno = _warning_site(ep, error, registered)
    warnings.warn_explicit(
        f"checkpointables plugin {ep.name!r} ({ep.value}) from distribution "
        f"{distribution or 'unknown'} {what}",
        RuntimeWarning,
        filename,
        lineno,
        module=ep.module,
    )


def _warning_site(
    ep: importlib_metadata.EntryPoint, error: BaseException | None, registered: object
) -> tuple[str, int]:
    """Where a warning about plugin ``ep`` points: the innermost line of the plugin's package
    that ``error`` passed through, else its handler hook, else its module, else the entry
    point itself (a module that is not there)."""
    package = ep.module.rpartition(".")[0] or ep.module
    if error is not None:
        frames = [
            (frame.f_code.co_filename, lineno)
            for frame, lineno in traceback.walk_tb(error.__traceback__)
            if frame.f_globals.get("__name__", "") in (package, ep.module)
            or str(frame.f_globals.get("__name__", "")).startswith(package + ".")
        ]
        if frames:
            return frames[-1]
    if isinstance(registered, _Registered) and registered.handler_hook is not None:
        return registered.handler_hook
    file = getattr(sys.modules.get(ep.module), "__file__", None)
    if file:
        return file, 1
    return f"<checkpointables entry point {ep.name} = {ep.value}>", 0


def _warn_contested(registrations: Iterable[HandlerRegistration]) -> None:
    """Warns of each typestr two plugins' handlers claim: loads of it refuse (neither
    plugin may read what the other may have written), so the user must choose."""
    for claimed, claimants in contested_typestrs(registrations).items():
        names = " and ".join(describe_claimant(r) for r in claimants)
        entry_names = ",".join(dict.fromkeys(r.plugin for r in claimants))
        warnings.warn(
            f"checkpointables plugins clash: {names} both claim the typestr {claimed!r}, so "
            f"checkpoints recording it are read by neither (nor saved) until you choose: "
            f"uninstall one, or block it with {DISABLE_ENV_VAR} (one of {entry_names}), or force "
            f"a handler per checkpointable with "
            f"cp.options.CheckpointablesOptions.create_with_handlers.",
            RuntimeWarning,
            stacklevel=3,
        )


_lock = threading.RLock()
_cached: _Discovery | None = None
_discovering = False


def _discovery() -> _Discovery:
    global _cached, _discovering
    with _lock:
        if _cached is None:
            if _discovering:  # Only this thread can be here: it holds the lock.
                raise RuntimeError(
                    "A plugin looked up what plugins register (a handler, an option class such "
                    "as cp.options.StorageOptions, ...) while plugins were being discovered: at "
                    "import or in a hook. Look it up later, or import the class from its plugin."
                )
            _discovering = True
            try:
                _cached = discover()
            finally:
                _discovering = False
        return _cached


def refresh() -> None:
    """Forgets discovered plugins; the next use discovers them again."""
    global _cached
    with _lock:
        _cached = None


def list_plugins() -> list[PluginInfo]:
    """Every entry point in the group, loaded or not, sorted by name."""
    return list(_discovery().plugins)


def handler_registrations() -> tuple[HandlerRegistration, ...]:
    """Handlers registered by plugins, in resolution order."""
    return _discovery().handlers


def leaf_registrations() -> tuple[LeafRegistration, ...]:
    """Leaf handlers registered by plugins, in plugin-name order."""
    return _discovery().leaves


def reader_registrations() -> tuple[ReaderRegistration, ...]:
    """Pytree readers registered by plugins, in the order they are asked."""
    return _discovery().readers


def command_registrations() -> tuple[CommandRegistration, ...]:
    """Subcommands of ``checkpointables`` registered by plugins, in plugin-name order."""
    return _discovery().commands


def option_registrations() -> tuple[OptionRegistration, ...]:
    """Option classes registered by plugins (``register_options``), in plugin-name order."""
    return _discovery().options


def storage_factories() -> dict[str, Callable[..., Any]]:
    """Storage backends registered by plugins, by URL scheme (a scheme two plugins register
    for different factories is settled as handler names are: ``docs/handler-resolution.md``)."""
    found: dict[str, Callable[..., Any]] = {}
    for registration in _discovery().storages:
        found.setdefault(registration.scheme, registration.factory)
    return found
