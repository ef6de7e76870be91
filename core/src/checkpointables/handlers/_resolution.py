"""Choosing a handler: pure functions of the registrations and the object or metadata."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from checkpointables import errors, plugins
from checkpointables.plugins import HandlerRegistration, PluginInfo
from checkpointables.protocols import ExplainsUnhandleable

# Typestr prefixes of handlers shipped by known distributions: for the
# "pip install" hint when a checkpoint needs a plugin that is not installed.
_KNOWN_DISTRIBUTIONS: tuple[tuple[str, str], ...] = (
    ("checkpointables_pytree.", "checkpointables-pytree"),
    ("checkpointables_json.", "checkpointables-json"),
    ("checkpointables_proto.", "checkpointables-proto"),
    ("checkpointables_grain.", "checkpointables-grain"),
    ("orbax.checkpoint.experimental.v1._src.handlers.pytree_handler.", "checkpointables-pytree"),
    ("orbax.checkpoint._src.handlers.pytree_checkpoint_handler.", "checkpointables-pytree"),
    ("orbax.checkpoint._src.handlers.standard_checkpoint_handler.", "checkpointables-pytree"),
    ("orbax.checkpoint.experimental.v1._src.handlers.json_handler.", "checkpointables-json"),
    ("orbax.checkpoint._src.handlers.json_checkpoint_handler.", "checkpointables-json"),
    ("orbax.checkpoint.experimental.v1._src.handlers.proto_handler.", "checkpointables-proto"),
    ("orbax.checkpoint._src.handlers.proto_checkpoint_handler.", "checkpointables-proto"),
    ("grain.", "checkpointables-grain"),
)


def _known_distribution(recorded_typestr: str) -> str | None:
    for prefix, distribution in _KNOWN_DISTRIBUTIONS:
        if recorded_typestr.startswith(prefix):
            return distribution
    return None


def unavailable_plugin(recorded_typestr: str, distribution: str | None) -> PluginInfo | None:
    """The installed plugin that would provide the typestr but is disabled or failed to load:
    the one of the distribution, or the one whose module the typestr is in; ``None`` if
    none is (the plugin is absent, or loaded)."""
    for info in plugins.list_plugins():
        if info.status == "loaded":
            continue
        same_distribution = (
            distribution is not None
            and info.distribution is not None
            and plugins.canonical_distribution(info.distribution)
            == plugins.canonical_distribution(distribution)
        )
        module = info.value.partition(":")[0]
        if same_distribution or recorded_typestr.startswith(module + "."):
            return info
    return None


def install_hint(recorded_typestr: str, distribution: tuple[str, str | None] | None = None) -> str:
    """A sentence telling what provides a typestr and what to do, or ``""``.

    ``distribution`` is the ``(name, version)`` the checkpoint recorded for the
    plugin that saved it. A plugin that is installed but disabled (by
    ``CHECKPOINTABLES_DISABLE_PLUGINS``) or failed to load is named as such;
    otherwise the distribution to install: ours by the typestr, a third party's
    as the checkpoint recorded it.
    """
    known = _known_distribution(recorded_typestr)
    # Our own typestrs name our distribution, whatever a (maybe crafted) checkpoint says.
    name, version = (known, None) if known else (distribution or (None, None))
    unavailable = unavailable_plugin(recorded_typestr, name)
    if unavailable is not None:
        origin = f" of {unavailable.distribution}" if unavailable.distribution else ""
        if unavailable.status == "disabled":
            return (
                f" It is provided by plugin {unavailable.name!r}{origin}, which is installed but "
                f"disabled by {plugins.DISABLE_ENV_VAR}: remove {unavailable.name!r} from that "
                f"environment variable, then run again."
            )
        return (
            f" It is provided by plugin {unavailable.name!r}{origin}, which is installed but "
            f"failed to load ({unavailable.error}): fix or reinstall it (`checkpointables "
            f"plugins` shows the error), then run again."
        )
    if known:
        return f" It is provided by the {known} plugin: pip install {known}, then run again."
    if name is None:
        return ""
    pinned = f"{name}=={version}" if version else name
    return (
        f" The checkpoint records that it was saved by a plugin of the distribution {name}"
        f"{f' {version}' if version else ''}: if you trust it, pip install '{pinned}' (or a later "
        f"version), then run again."
    )


def refuse_contested(
    registrations: Sequence[HandlerRegistration], claimed: str, name: str, doing: str
) -> None:
    """Raises ``PluginError`` if handlers of two classes claim the typestr ``claimed``.

    Which of them wrote data recorded under it cannot be told, and data one plugin
    wrote must never be read by another unless the user says so; so neither is used
    for checkpointable ``name`` (``doing``: what was asked, for the message).
    """
    claimants = plugins.contested_typestrs(
        r for r in registrations if r.matches_typestr(claimed)
    ).get(claimed)
    if not claimants:
        return
    names = " and ".join(plugins.describe_claimant(r) for r in claimants)
    removals = "; ".join(
        f"cp.handlers.unregister_handler({r.handler_cls.__qualname__})"
        if r.plugin == plugins.USER_PLUGIN
        else f"{plugins.DISABLE_ENV_VAR}={r.plugin}"
        for r in claimants
    )
    raise errors.PluginError(
        f"Cannot {doing} checkpointable {name!r}: its typestr {claimed!r} is claimed by "
        f"{names}, so which of them wrote such data cannot be told, and neither is used. Say "
        f"which handler reads it, in cp.Context(checkpointables_options=cp.options."
        f"CheckpointablesOptions.create_with_handlers({name}=<handler name or class>)), or "
        f"remove one claimant (uninstall its plugin, or one of: {removals})."
    )


def _describe(registrations: Sequence[HandlerRegistration], *, typestrs: bool = False) -> str:
    """The handlers by name and the class that runs (not the typestr it records, which may
    be Orbax's class name); with ``typestrs``, the typestr each reads too, for load errors
    that compare it with the one a checkpoint recorded."""

    def one(r: HandlerRegistration) -> str:
        cls = f"{r.handler_cls.__module__}.{r.handler_cls.__qualname__}"
        reads = f", reads {r.typestr}" if typestrs and r.typestr != cls else ""
        return f"{r.name} ({cls}{reads})"

    return ", ".join(one(r) for r in registrations) or "none registered"


def _reason(instance: Any, checkpointable: Any) -> str:
    """Why a handler rejects an object: its ``unhandleable_reason(obj)``
    (``cp.protocols.ExplainsUnhandleable``), or ``""``."""
    if not isinstance(instance, ExplainsUnhandleable):
        return ""
    try:
        return instance.unhandleable_reason(checkpointable) or ""
    except Exception:  # An explanation must never hide the real error.
        return ""


_FLAX_ADVICE = (
    "Flax linen: the variables init returns, or a TrainState, not the Module; "
    "Flax NNX: the module or nnx.state(model)"
)


def _equinox_module_path(checkpointable: Any) -> str | None:
    """The key path ("" for the root) of the first ``eqx.Module`` in ``checkpointable``
    that holds functions (activations, say), which no leaf handler saves; or ``None``.
    Equinox is never imported here: such a module exists only if it was."""
    equinox = sys.modules.get("equinox")
    module_type = getattr(equinox, "Module", None)
    if not isinstance(module_type, type):
        return None
    import jax

    def is_module(x: Any) -> bool:
        return isinstance(x, module_type)

    try:
        found, _ = jax.tree_util.tree_flatten_with_path(checkpointable, is_leaf=is_module)
        for keypath, node in found:
            if is_module(node) and any(callable(x) for x in jax.tree_util.tree_leaves(node)):
                return jax.tree_util.keystr(keypath)
    except Exception:  # Advice must never hide the real error.
        return None
    return None


def _equinox_advice(checkpointable: Any) -> str:
    """What to save instead of an Equinox module holding functions (docs/recipes.md), or
    ""."""
    where = _equinox_module_path(checkpointable)
    if where is None:
        return ""
    model = f"the eqx.Module at {where}" if where else "the tree, an eqx.Module,"
    return (
        f"Equinox: {model} holds functions besides its arrays. Save the arrays, "
        f"eqx.filter(model, eqx.is_array) (the first part of eqx.partition(model, "
        f"eqx.is_array)), and load them into the same filtered abstract tree (the first part "
        f"of eqx.partition(eqx.filter_eval_shape(make_model, ...), lambda x: isinstance(x, "
        f"jax.ShapeDtypeStruct)), or eqx.filter of a fresh model), then eqx.combine it with "
        f"the rest: see docs/recipes.md, 'Equinox'"
    )


def _forced_refusal(
    registrations: Sequence[HandlerRegistration], forced: Any, checkpointable: Any, name: str
) -> str:
    """Why the handler forced for ``name`` (``forced``, an instance) refuses the object, and
    what to do: pytree advice only where it is the pytree handler (``cp.save_pytree``'s),
    which a user of another handler, forced with ``create_with_handlers``, has no use for."""
    cls = type(forced)
    why = _reason(forced, checkpointable)
    pytree = any(r.handler_cls is cls and r.name == "pytree" for r in registrations)
    which = (
        "save_pytree's handler, or the one CheckpointablesOptions forces for it"
        if pytree
        else f"the handler CheckpointablesOptions.create_with_handlers({name}=...) forces for it"
    )
    head = (
        f"Checkpointable {name!r} is saved by {cls.__module__}.{cls.__qualname__} ({which}), "
        f"which cannot save an object of type "
        f"{type(checkpointable).__module__}.{type(checkpointable).__qualname__}"
        f"{f' ({why})' if why else ''}."
    )
    if pytree:
        return (
            f"{head} Pass an object it accepts: a pytree of arrays "
            f"({_equinox_advice(checkpointable) or _FLAX_ADVICE})."
            f"{_unforce_advice(registrations, cls, checkpointable, name)}"
        )
    savers = handlers_accepting(registrations, checkpointable, excluding=(cls,), first=True)
    chosen = f" (the {savers[0].name} handler saves it)" if savers else ""
    return (
        f"{head} Pass an object it accepts, or drop {name}= from "
        f"CheckpointablesOptions.create_with_handlers so that the handler is chosen by the "
        f"object{chosen}."
    )


def _unforce_advice(
    registrations: Sequence[HandlerRegistration], forced: type, checkpointable: Any, name: str
) -> str:
    """What to do instead when the handler forced for ``name`` cannot save the object: the
    registered handler that can, by name, where there is one."""
    savers = handlers_accepting(registrations, checkpointable, excluding=(forced,), first=True)
    if not savers and _is_container(checkpointable):
        return ""  # A pytree none saves whole: the reason (its bad leaves) says what to do.
    who = f"The {savers[0].name} handler saves it" if savers else "If the object is not a pytree"
    return (
        f" {who}: save it with cp.save_checkpointables({{{name!r}: obj}}), "
        f"which picks the handler by the object (JSON, proto, your own), rather than "
        f"cp.save_pytree; and if CheckpointablesOptions.create_with_handlers({name}=...) is in "
        f"force, drop {name}= from it."
    )


def _is_container(checkpointable: Any) -> bool:
    """Whether ``checkpointable`` is a pytree node (a dict, a list, a dataclass pytree...),
    not a single leaf."""
    import jax

    try:
        leaves = jax.tree_util.tree_leaves(checkpointable, is_leaf=lambda x: x is None)
    except Exception:  # Only for advice: an object jax cannot flatten is no container.
        return False
    return not (len(leaves) == 1 and leaves[0] is checkpointable)


def handlers_accepting(
    registrations: Sequence[HandlerRegistration],
    checkpointable: Any,
    *,
    excluding: Sequence[type] = (),
    first: bool = False,
) -> list[HandlerRegistration]:
    """The registrations, in the order given (``registered_handlers()`` gives resolution
    order), whose handler's ``is_handleable`` accepts ``checkpointable``, leaving out the
    handler classes ``excluding``; with ``first``, only the first such one.

    For advice in errors, e.g. a plugin naming the handler that would save an object it
    refuses (``cp.handlers.handlers_accepting(cp.handlers.registered_handlers(), leaf,
    excluding=(MyHandler,))``). A handler whose ``is_handleable`` raises counts as not
    accepting: a third-party handler's failure must not hide the error being explained.
    """
    found = []
    for registration in registrations:
        if registration.handler_cls in excluding:
            continue
        try:
            accepts = bool(registration.handler_cls().is_handleable(checkpointable))
        except Exception:
            accepts = False
        if accepts:
            found.append(registration)
            if first:
                break
    return found


def _orbax_args_name(checkpointable: Any) -> str | None:
    """``ocp.args.<Name>`` if ``checkpointable`` is an Orbax Checkpoint ``args`` wrapper
    (``StandardSave``, ``PyTreeSave``, ``JsonSave``, ``Composite``...), else ``None``.

    Told by its classes' module and name alone: orbax is never imported here, and no
    attribute of the object is read (``Composite`` turns attribute reads into key lookups).
    """
    classes = type(checkpointable).__mro__
    if not any(
        # A class's module may be None (protobuf messages) or anything a user assigned.
        isinstance(c.__module__, str)
        and c.__module__.startswith("orbax.checkpoint")
        and c.__name__ == "CheckpointArgs"
        for c in classes
    ):
        return None
    name = type(checkpointable).__name__
    return f"ocp.args.{name.removesuffix('Args') or name}"


def _refuse_orbax_args(checkpointable: Any, name: str, *, loading: bool = False) -> None:
    """Raises if ``checkpointable`` (an abstract one when ``loading``) is an Orbax ``args``
    wrapper, saying what to pass instead: we choose the handler from the object itself,
    so it goes in unwrapped. Saving raises ``NoHandlerForObjectError``, loading
    ``InvalidArgumentTypeError``."""
    wrapper = _orbax_args_name(checkpointable)
    if wrapper is None:
        return
    call = "cp.load_checkpointables(path, " if loading else "cp.save_checkpointables(path, "
    if isinstance(checkpointable, Mapping):  # ocp.args.Composite: one wrapper per item.
        items = ", ".join(f"{key!r}: <{key}>" for key in checkpointable) or "'name': <object>"
        instead = (
            f"a dict of its items, each the object itself rather than its args wrapper: "
            f"{call}{{{items}}})"
        )
    elif loading:
        instead = (
            f"the abstract object you wrapped in {wrapper}(...) itself (or None), e.g. "
            f"{call}{{{name!r}: abstract_pytree}}) or cp.load_pytree(path, abstract_pytree)"
        )
    else:
        instead = (
            f"the object you wrapped in {wrapper}(...) itself, e.g. "
            f"{call}{{{name!r}: pytree}}) or cp.save_pytree(path, pytree)"
        )
    error = errors.InvalidArgumentTypeError if loading else errors.NoHandlerForObjectError
    raise error(
        f"{'The abstract object for c' if loading else 'C'}heckpointable {name!r} is an Orbax "
        f"Checkpoint argument wrapper, {wrapper} ({type(checkpointable).__module__}."
        f"{type(checkpointable).__qualname__}). checkpointables takes no args wrappers: it "
        f"chooses the handler from the object. Pass {instead}."
    )


def resolve_for_save(
    registrations: Sequence[HandlerRegistration],
    checkpointable: Any,
    *,
    name: str,
    forced: type | None = None,
) -> tuple[HandlerRegistration | None, Any]:
    """Chooses the handler that saves ``checkpointable`` under ``name``.

    ``registrations`` must be in resolution order. A handler forced for the
    name (by ``CheckpointablesOptions``) wins; then a handler registered for
    this checkpointable name; then the first whose ``is_handleable`` accepts
    the object.

    Returns:
      ``(registration, handler instance)``; the registration is ``None`` for a
      forced handler that was never registered.
    """
    if checkpointable is None:
        raise errors.InvalidArgumentError(
            f"Checkpointable {name!r} is None; there is nothing to save."
        )
    _refuse_orbax_args(checkpointable, name)
    if forced is not None:
        instance = forced()
        if not instance.is_handleable(checkpointable):
            raise errors.NoHandlerForObjectError(
                _forced_refusal(registrations, instance, checkpointable, name)
            )
        match = next((r for r in registrations if r.handler_cls is forced), None)
        if match is not None:
            refuse_contested(registrations, match.typestr, name, "save")
        return match, instance
    scoped = [r for r in registrations if r.checkpointable_name == name]
    generic = [r for r in registrations if r.checkpointable_name is None]
    reasons = ""
    for r in scoped + generic:
        instance = r.handler_cls()
        if instance.is_handleable(checkpointable):
            refuse_contested(registrations, r.typestr, name, "save")
            return r, instance
        why = _reason(instance, checkpointable)
        if why:
            reasons += f" {r.name}: {plugins.sentence(why)}"
    equinox = _equinox_advice(checkpointable)
    raise errors.NoHandlerForObjectError(
        f"No handler can save checkpointable {name!r} of type "
        f"{type(checkpointable).__module__}.{type(checkpointable).__qualname__}. "
        f"Handlers tried, in order: {_describe(scoped + generic)}.{reasons} "
        f"{f'{equinox}. Or give' if equinox else 'Give'} the object "
        f"save/load methods (cp.StatefulCheckpointable), register a handler for it with "
        f"cp.handlers.register_handler, or install the plugin that handles it."
    )


def _redirect(
    registrations: Sequence[HandlerRegistration], name: str, abstract: Any
) -> tuple[HandlerRegistration, Any] | None:
    """The first handler, in resolution order, whose ``is_abstract_handleable(abstract)`` is
    true (for ``name``), with an instance of it; ``None`` if none is."""
    for r in registrations:
        if r.checkpointable_name not in (None, name):
            continue
        instance = r.handler_cls()
        if instance.is_abstract_handleable(abstract) is True:
            return r, instance
    return None


def _missing(
    registrations: Sequence[HandlerRegistration],
    name: str,
    recorded: str | None,
    distribution: tuple[str, str | None] | None,
) -> str:
    """Why no handler loads checkpointable ``name``, and what to do."""
    if recorded is None:
        return (
            f"The checkpoint records no handler for checkpointable {name!r} and no registered "
            f"handler recognizes its directory ({_describe(registrations)}). Force one with "
            f"cp.options.CheckpointablesOptions.create_with_handlers({name}=...)."
        )
    return (
        f"Checkpointable {name!r} was saved by handler {recorded!r}, which is not "
        f"registered here (registered: {_describe(registrations, typestrs=True)})."
        f"{install_hint(recorded, distribution)}"
    )


def resolve_for_load(
    registrations: Sequence[HandlerRegistration],
    *,
    name: str,
    recorded_typestr: str | None,
    abstract: Any = None,
    forced: type | None = None,
    recognizers: Mapping[str, bool] | None = None,
    distribution: tuple[str, str | None] | None = None,
) -> tuple[HandlerRegistration | None, Any]:
    """Chooses the handler that loads checkpointable ``name``.

    1. A handler forced for the name wins.
    2. With an abstract checkpointable, the handler of the recorded typestr is
       used if its ``is_abstract_handleable`` is true or ``None`` (undecided);
       if it is false, the first handler, in resolution order, that says true
       takes over (the abstract object redirects the load).
    3. Otherwise the handler whose typestr or secondary typestr matches.
    4. With no typestr recorded (older checkpoints), the first handler that
       ``recognizers`` says recognizes the directory.

    Typestrs are only compared with registered handlers: nothing named in a
    checkpoint is ever imported. ``distribution``, the ``(name, version)`` the
    checkpoint recorded for the handler's plugin, only words the error when none is
    registered.
    """
    _refuse_orbax_args(abstract, name, loading=True)
    if forced is not None:
        match = next((r for r in registrations if r.handler_cls is forced), None)
        return match, forced()
    recorded = recorded_typestr
    by_typestr = None
    if recorded is not None:
        refuse_contested(registrations, recorded, name, "load")
        by_typestr = next((r for r in registrations if r.matches_typestr(recorded)), None)
    if by_typestr is not None:
        instance = by_typestr.handler_cls()
        if abstract is None or instance.is_abstract_handleable(abstract) is not False:
            return by_typestr, instance
    redirected = None if abstract is None else _redirect(registrations, name, abstract)
    if redirected is not None:
        return redirected
    if by_typestr is not None:
        raise errors.MissingHandlerError(
            f"Checkpointable {name!r} was saved by {recorded}, whose handler cannot load "
            f"into the given abstract object of type {type(abstract).__qualname__}, and no other "
            f"registered handler accepts that abstract object ({_describe(registrations)}). "
            f"Pass an abstract object the handler accepts, or None."
        )
    if recorded is None and recognizers:
        for r in registrations:
            if recognizers.get(r.name):
                return r, r.handler_cls()
    raise errors.MissingHandlerError(_missing(registrations, name, recorded, distribution))
