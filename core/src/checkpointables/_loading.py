"""``load_checkpointables``, ``checkpointables_metadata`` and their async forms."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from etils import epath

from checkpointables import (
    _commit,
    _confinement,
    _inflight,
    errors,
    execution,
    handlers,
    layout,
    metadata_checksums,
)
from checkpointables._asyncio import AsyncResponse, gather_awaitables, run_sync, start_background
from checkpointables.checkpoint_metadata import (
    CHECKPOINT_METADATA_FILE,
    CheckpointMetadata,
    read_checkpoint_metadata,
)
from checkpointables.context import Context, get_context
from checkpointables.path._parse import as_path
from checkpointables.protocols import Recognizing


class CheckpointableNotFoundError(errors.CheckpointError, KeyError):
    """A requested checkpointable is not in the checkpoint."""

    def __str__(self) -> str:
        return str(self.args[0])


def open_checkpoint(path: epath.PathLike, context: Context) -> tuple[epath.Path, dict[str, Any]]:
    """Validates ``path`` as a finished checkpoint that stays inside its directory, and reads
    its metadata."""
    opened = open_for_load(path, context)
    return opened.path, opened.meta


@attrs.frozen
class Opened:
    """A checkpoint opened for loading: its path, its metadata and its identity."""

    path: epath.Path
    meta: dict[str, Any]
    identity: Any  # See _commit.identity; checked again when the load ends.

    def check_unchanged(self, error: BaseException | None) -> None:
        """Raises ``CheckpointChangedError`` if the checkpoint was replaced since it was opened."""
        _commit.check_unchanged(self.path, self.identity, error)


def open_for_load(path: epath.PathLike, context: Context) -> Opened:
    """Validates ``path`` as a finished checkpoint that stays inside its directory, notes
    which one, reads its metadata."""
    path = as_path(path)
    _inflight.wait_for(path, context.async_options.timeout_secs)
    with context:  # An object store is reached as the context says.
        # The identity first: a replacement after this is noticed when the load ends.
        identity = _commit.identity(path)
        if (
            identity is None
            or layout.local_path(path) is not None
            or layout.is_temporary_path(path)
        ):
            layout.validate_checkpoint_directory(path)
            if identity is None:  # Committed just now.
                identity = _commit.identity(path)
                _commit.check_unchanged(path, identity, None)
        _confinement.check_contained(path)
        try:
            return Opened(path, read_checkpoint_metadata(path), identity)
        except errors.CheckpointError as e:  # Damaged, or replaced while opened?
            _commit.check_unchanged(path, identity, e)
            raise
        except FileNotFoundError:
            # Committed (validated above) but without its metadata: damaged or deleted meanwhile.
            _commit.check_unchanged(path, identity, None)
            raise errors.NotACheckpointError(
                f"{path} has a commit marker but no {CHECKPOINT_METADATA_FILE}; it is not a "
                f"checkpoint this library can read."
            ) from None


def recorded_typestrs(meta: Mapping[str, Any]) -> dict[str, str]:
    """``item_handlers`` as a dict (empty for flat V0 checkpoints)."""
    item_handlers = meta.get("item_handlers")
    return dict(item_handlers) if isinstance(item_handlers, dict) else {}


def _recognizers(directory: epath.Path) -> dict[str, bool]:
    result = {}
    for r in handlers.registered_handlers():
        if issubclass(r.handler_cls, Recognizing):
            result[r.name] = bool(r.handler_cls.recognizes(directory))
    return result


def resolve_load_handler(
    directory: epath.Path,
    name: str,
    recorded: str | None,
    abstract: Any,
    context: Context,
) -> Any:
    """The handler instance that loads checkpointable ``name`` from ``directory``."""
    forced = context.checkpointables_options.handlers.get(name)
    _, instance = handlers.resolve_for_load(
        handlers.registered_handlers(),
        name=name,
        recorded_typestr=recorded,
        abstract=abstract,
        forced=None if forced is None else handlers.get(forced),
        recognizers=_recognizers(directory) if recorded is None else None,
    )
    return instance


def available_checkpointables(path: epath.Path, meta: Mapping[str, Any]) -> list[str]:
    """The names of the checkpointables stored in checkpoint ``path``, sorted.

    Raises:
      cp.errors.IntegrityError: a checkpointable recorded in ``_CHECKPOINT_METADATA``
        has no directory (Orbax, too, records only what it saved).
    """
    typestrs = recorded_typestrs(meta)
    available = layout.checkpointable_directories(path, typestrs)
    missing = sorted(set(typestrs) - set(available))
    if missing:
        raise errors.IntegrityError(
            f"Checkpoint {path} recorded the checkpointables {missing}, but their directories "
            f"are missing: the checkpoint is damaged. Restore it from a copy, or load an older "
            f"checkpoint."
        )
    return available


def _requested(
    path: epath.Path, meta: Mapping[str, Any], abstract_checkpointables: Mapping[str, Any] | None
) -> dict[str, Any]:
    available = available_checkpointables(path, meta)
    if abstract_checkpointables is None or not abstract_checkpointables:
        return dict.fromkeys(available)
    if isinstance(abstract_checkpointables, CheckpointMetadata):
        abstract_checkpointables = abstract_checkpointables.metadata
    if not isinstance(abstract_checkpointables, Mapping):
        raise errors.InvalidArgumentError(
            "abstract_checkpointables must be a dict of name to abstract checkpointable, got "
            f"{type(abstract_checkpointables).__name__}; to load one pytree use cp.load_pytree."
        )
    missing = [n for n in abstract_checkpointables if n not in available]
    if missing:
        raise CheckpointableNotFoundError(
            f"Checkpoint {path} has no checkpointable named {missing}; it holds {available}."
        )
    return dict(abstract_checkpointables)


def load_items_async(
    opened: Opened,
    items: Mapping[str, tuple[epath.Path, Any]],
    context: Context,
    *,
    wait: bool = False,
) -> AsyncResponse[dict[str, Any]]:
    """Loads ``{name: (directory, abstract)}`` with the recorded handlers.

    With ``wait`` (a synchronous load) the reading runs on the caller's thread
    and the returned response is already done. A load that fails, or ends
    after the checkpoint was replaced, raises ``CheckpointChangedError`` if
    the checkpoint changed meanwhile.
    """
    path, meta = opened.path, opened.meta
    typestrs = recorded_typestrs(meta)
    flat_typestr = meta.get("item_handlers") if isinstance(meta.get("item_handlers"), str) else None
    instances = {}
    for name, (directory, abstract) in items.items():
        recorded = typestrs.get(name, flat_typestr if directory == path else None)
        instances[name] = resolve_load_handler(directory, name, recorded, abstract, context)

    async def named(name: str, directory: epath.Path, awaitable: Any) -> Any:
        try:
            return await awaitable
        except Exception as e:
            e.add_note(f"while loading checkpointable {name!r} from {directory}")
            raise

    async def blocking_phase() -> list[Any]:
        return await gather_awaitables(
            [
                named(n, directory, instances[n].load(directory, abstract))
                for n, (directory, abstract) in items.items()
            ]
        )

    def background() -> dict[str, Any]:
        try:
            values = run_sync(
                gather_awaitables(
                    [
                        named(n, d, a)
                        for (n, (d, _)), a in zip(items.items(), awaitables, strict=True)
                    ]
                )
            )
        except Exception as e:
            opened.check_unchanged(e)
            raise
        opened.check_unchanged(None)
        return dict(zip(items, values, strict=True))

    with context:  # Handlers read options through get_context().
        try:
            awaitables = run_sync(blocking_phase())
        except Exception as e:
            opened.check_unchanged(e)
            raise
        return start_background(background, f"load of {path}", daemon=True, inline=wait)


@metadata_checksums.scope()  # One lookup of _CHECKSUMS per operation.
def load_checkpointables_async(
    path: epath.PathLike,
    abstract_checkpointables: Mapping[str, Any] | None = None,
    *,
    context: Context | None = None,
    _wait: bool = False,
) -> AsyncResponse[dict[str, Any]]:
    """Starts loading checkpointables; reading happens in the background.

    ``abstract_checkpointables`` selects names (a value of ``None`` loads that
    name as saved) and guides each load; ``None`` loads everything.
    """
    context = get_context(context)
    opened = open_for_load(path, context)
    path = opened.path
    try:
        with context:
            requested = _requested(path, opened.meta, abstract_checkpointables)
    except Exception as e:
        opened.check_unchanged(e)
        raise
    return load_items_async(
        opened, {n: (path / n, a) for n, a in requested.items()}, context, wait=_wait
    )


def load_checkpointables(
    path: epath.PathLike, abstract_checkpointables: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Loads checkpointables from a checkpoint.

    Example::

        everything = cp.load_checkpointables(path)
        just_state = cp.load_checkpointables(path, {"pytree": abstract_state})

    Raises:
      FileNotFoundError: ``path`` does not exist.
      cp.errors.NotACheckpointError: ``path`` is not a finished checkpoint.
      KeyError: a requested name is not in the checkpoint.
      cp.errors.MissingHandlerError: a needed handler is not installed.
    """
    with execution.paused_gc():
        response = load_checkpointables_async(path, abstract_checkpointables, _wait=True)
    return response.result()


def item_metadata(directory: epath.Path, name: str, recorded: str | None, context: Context) -> Any:
    """The abstract form of one checkpointable, from its handler."""
    instance = resolve_load_handler(directory, name, recorded, None, context)
    return run_sync(instance.metadata(directory))


@metadata_checksums.scope()  # One lookup of _CHECKSUMS per operation.
def checkpointables_metadata(path: epath.PathLike) -> CheckpointMetadata[dict[str, Any]]:
    """What a checkpoint holds: ``.metadata`` maps each name to its abstract form.

    Example::

        meta = cp.checkpointables_metadata(path)
        meta.metadata["pytree"], meta.custom_metadata
    """
    context = get_context()
    path, meta = open_checkpoint(path, context)
    typestrs = recorded_typestrs(meta)
    with context:
        names = available_checkpointables(path, meta)
    result = {n: item_metadata(path / n, n, typestrs.get(n), context) for n in names}
    return checkpoint_metadata_for(path, meta, result)


def checkpoint_metadata_for(
    path: epath.Path, meta: Mapping[str, Any], value: Any
) -> CheckpointMetadata[Any]:
    """Wraps ``value`` with the timestamps and custom metadata of a checkpoint."""
    return CheckpointMetadata(
        path,
        metadata=value,
        custom_metadata=meta.get("custom_metadata"),
        init_timestamp_nsecs=meta.get("init_timestamp_nsecs"),
        commit_timestamp_nsecs=meta.get("commit_timestamp_nsecs"),
        metrics=meta.get("metrics"),
    )
