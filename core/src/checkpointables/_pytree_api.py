"""The pytree free functions: one checkpointable, handled by the ``pytree`` plugin."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from etils import epath

from checkpointables import (
    _loading,
    _saving,
    errors,
    handlers,
    layout,
    metadata_checksums,
    options,
    readers,
)
from checkpointables._asyncio import AsyncResponse, synchronous
from checkpointables.checkpoint_metadata import CheckpointMetadata, recorded_distribution
from checkpointables.context import Context, get_context
from checkpointables.handlers._resolution import install_hint
from checkpointables.path._parse import as_path
from checkpointables.protocols import Recognizing

PYTREE_HANDLER_NAME = "pytree"
DEFAULT_NAME = "pytree"
# Tried in this order when no name is given; then the only other pytree present (with
# several others, the caller must name one: picking one would be a guess).
PREFERRED_NAMES = ("pytree", "state")


def pytree_registration() -> handlers.HandlerRegistration:
    """The registration of the handler named ``pytree``, or a pip-install hint."""
    for r in handlers.registered_handlers():
        if r.name == PYTREE_HANDLER_NAME:
            return r
    raise errors.MissingHandlerError(
        "Saving and loading pytrees needs the pytree plugin, which is not installed or failed "
        "to load (see `checkpointables plugins`): pip install checkpointables-pytree."
    )


def holds_pytree(directory: epath.Path) -> bool:
    """Whether the pytree handler recognizes ``directory`` as its own (``cp.protocols.
    Recognizing``; core knows nothing of its files); false without the pytree plugin."""
    try:
        handler_cls = pytree_registration().handler_cls
    except errors.MissingHandlerError:
        return False
    return issubclass(handler_cls, Recognizing) and bool(handler_cls.recognizes(directory))


def pytree_item(checkpointable_name: str, pytree: Any) -> dict[str, Any]:
    """``{checkpointable_name: pytree}``, after the checks every pytree save makes."""
    layout.validate_checkpointable_name(checkpointable_name)
    if pytree is None:
        raise errors.InvalidArgumentError("The pytree to save is None; there is nothing to save.")
    return {checkpointable_name: pytree}


def save_pytree_async(
    path: epath.PathLike,
    pytree: Any,
    *,
    checkpointable_name: str = DEFAULT_NAME,
    overwrite: bool = False,
    custom_metadata: Mapping[str, Any] | None = None,
    reuse_from: epath.PathLike | None = None,
) -> AsyncResponse[None]:
    """Saves a pytree; returns once device data is copied to host.

    The caller may change or delete its arrays as soon as this returns. ``reuse_from``: a
    committed checkpoint on the same storage whose unchanged arrays are linked rather
    than written, from its checkpointable of this one's name (``pytree`` by default; a
    Checkpointer's steps name it ``state``), or else its only pytree
    (``docs/incremental.md``).
    """
    return _saving.start(
        _saving.SaveRequest(
            path,
            pytree_item(checkpointable_name, pytree),
            custom_metadata,
            overwrite,
            forced_handlers={checkpointable_name: pytree_registration().handler_cls},
            reuse=reuse_from,
        )
    )


@synchronous(save_pytree_async)
def save_pytree(
    path: epath.PathLike,
    pytree: Any,
    *,
    checkpointable_name: str = DEFAULT_NAME,
    overwrite: bool = False,
    custom_metadata: Mapping[str, Any] | None = None,
    reuse_from: epath.PathLike | None = None,
) -> None:
    """Saves a pytree of arrays and scalars, and waits until it is committed.

    ``reuse_from``: an earlier committed checkpoint on the same storage; the arrays
    that did not change since it are linked (hard links; on S3, server-side copies)
    rather than written, and the new checkpoint stays complete on its own (see
    ``save_pytree_async`` and ``docs/incremental.md``).

    Example::

        cp.save_pytree("/tmp/ckpt/100", {"params": params, "step": 100})
        cp.save_pytree("/tmp/ckpt/200", {"params": params, "step": 200},
                       reuse_from="/tmp/ckpt/100")
    """


def find_pytree(
    path: epath.Path, meta: Mapping[str, Any], checkpointable_name: str | None
) -> tuple[str, epath.Path]:
    """The name and directory of the pytree to load from checkpoint ``path``.

    With no ``checkpointable_name``: a flat (Orbax V0) checkpoint's root; else the
    pytree named ``pytree``, else ``state``, else the only pytree present.

    Raises:
      cp.errors.InvalidArgumentError: several pytrees, none of the preferred names.
      cp.errors.CheckpointableNotFoundError: no checkpointable ``checkpointable_name``,
        or no pytree at all.
    """
    typestrs = _loading.recorded_typestrs(meta)
    available = _loading.available_checkpointables(path, meta)
    if checkpointable_name is not None:
        layout.validate_checkpointable_name(checkpointable_name)
        if checkpointable_name not in available:
            raise _loading.checkpointable_not_found(
                path,
                [checkpointable_name],
                available,
                "Pass checkpointable_name= one of those (or None to find the pytree).",
            )
        return checkpointable_name, path / checkpointable_name
    if isinstance(meta.get("item_handlers"), str) or (not typestrs and holds_pytree(path)):
        return DEFAULT_NAME, path  # A flat (Orbax V0) checkpoint: the pytree is the root.
    try:
        registration: handlers.HandlerRegistration | None = pytree_registration()
    except errors.MissingHandlerError:
        registration = None

    def is_pytree(name: str) -> bool:
        recorded = typestrs.get(name)
        if recorded is not None and registration is not None:
            return registration.matches_typestr(recorded)
        return holds_pytree(path / name)

    for name in PREFERRED_NAMES:
        if name in available and is_pytree(name):
            return name, path / name
    others = [n for n in available if n not in PREFERRED_NAMES and is_pytree(n)]
    if len(others) == 1:
        return others[0], path / others[0]
    if others:
        raise errors.InvalidArgumentError(
            f"Checkpoint {path} holds several pytrees, {others}, and none named "
            f"{' or '.join(map(repr, PREFERRED_NAMES))}: pass checkpointable_name=... to say "
            f"which to load, or load them all with cp.load_checkpointables."
        )
    ordered = [n for n in PREFERRED_NAMES if n in available] + [
        n for n in available if n not in PREFERRED_NAMES
    ]
    _raise_if_saved_by_a_missing_handler(path, meta, ordered)
    if registration is None:  # Without the plugin, nothing can tell its directories.
        pytree_registration()
    raise errors.CheckpointableNotFoundError(
        f"Checkpoint {path} holds no pytree; it holds {_loading.held(available)}. Pass "
        f"checkpointable_name= the one to load, or load them all with cp.load_checkpointables."
    )


def _no_name_for_readers(path: epath.PathLike, checkpointable_name: str | None) -> None:
    if checkpointable_name is not None:
        raise ValueError(
            f"{path} is not a checkpoint directory but a file or directory of another format, "
            f"which holds one pytree: drop checkpointable_name={checkpointable_name!r}."
        )


def _raise_if_saved_by_a_missing_handler(
    path: epath.Path, meta: Mapping[str, Any], names: list[str]
) -> None:
    """Raises ``MissingHandlerError`` when one of ``names`` was saved by an unregistered handler.

    Such a checkpointable may be the pytree asked for: the error names the
    typestr (and the plugin to install) rather than saying there is no pytree.
    """
    registered = handlers.registered_handlers()
    typestrs = _loading.recorded_typestrs(meta)
    for name in names:
        recorded = typestrs.get(name)
        if recorded is not None and not any(r.matches_typestr(recorded) for r in registered):
            hint = install_hint(recorded, recorded_distribution(meta, name))
            raise errors.MissingHandlerError(
                f"Checkpoint {path} holds no pytree this installation can read: checkpointable "
                f"{name!r} was saved by handler {recorded!r}, which is not registered here."
                f"{hint} Install the plugin that provides it, or pass "
                "checkpointable_name=... to load another checkpointable."
            )


def _with_partial_load(context: Context, partial_load: bool) -> Context:
    if not options.checked_bool(partial_load, "partial_load"):
        return context
    return context.replace(pytree_options=attrs.evolve(context.pytree_options, partial_load=True))


def load_pytree_async(
    path: epath.PathLike,
    abstract_pytree: Any = None,
    *,
    checkpointable_name: str | None = None,
    partial_load: bool = False,
) -> AsyncResponse[Any]:
    """Starts loading a pytree; reading happens in the background."""
    context = _with_partial_load(get_context(), partial_load)
    if isinstance(abstract_pytree, CheckpointMetadata):
        abstract_pytree = abstract_pytree.metadata
    reader = readers.reader_for(path)
    if reader is not None:  # Another format (e.g. safetensors), read by a plugin.
        _no_name_for_readers(path, checkpointable_name)
        return readers.load_async(reader, as_path(path), abstract_pytree, context)

    def choose(opened: _loading.Opened) -> _loading.Items:
        name, directory = find_pytree(opened.path, opened.meta, checkpointable_name)
        return {name: (directory, abstract_pytree)}

    return _loading.start_load(path, context, choose, lambda values: next(iter(values.values())))


@synchronous(load_pytree_async)
def load_pytree(
    path: epath.PathLike,
    abstract_pytree: Any = None,
    *,
    checkpointable_name: str | None = None,
    partial_load: bool = False,
) -> Any:
    """Loads a pytree.

    With no ``abstract_pytree`` it loads as saved, on any machine (arrays saved
    as ``jax.Array`` come back on the default device). Abstract leaves choose
    the result: ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` gives a
    ``jax.Array`` with that sharding; ``np.empty(shape, dtype)`` gives NumPy;
    ``0.0`` gives a float; ``None`` or ``cp.PLACEHOLDER`` skips the leaf.

    Example::

        state = cp.load_pytree(path, cp.pytree_metadata(path).metadata)
    """


@metadata_checksums.scope()  # One lookup of _CHECKSUMS per operation.
def pytree_metadata(
    path: epath.PathLike, *, checkpointable_name: str | None = None
) -> CheckpointMetadata[Any]:
    """The abstract tree of a stored pytree (usable as ``abstract_pytree``), cheaply."""
    context = get_context()
    reader = readers.reader_for(path)
    if reader is not None:
        _no_name_for_readers(path, checkpointable_name)
        return readers.metadata(reader, as_path(path), context)
    opened = _loading.open_for_load(path, context)
    with context:
        name, directory = find_pytree(opened.path, opened.meta, checkpointable_name)
    recorded = opened.typestr(name, directory) or pytree_registration().typestr
    distribution = opened.distribution(name)
    return opened.metadata_of(
        _loading.item_metadata(directory, name, recorded, context, distribution)
    )
