"""``load_checkpointables``, ``checkpointables_metadata`` and their async forms.

Every load (these, the pytree functions, the training Checkpointer) runs the
same phases through ``start_load``:

1. **open**: the path is a finished checkpoint that stays inside its
   directory; note which one (to notice a replacement later) and read its metadata;
2. **choose** what to load (the caller's part), with a handler for each;
3. **blocking**: each handler's blocking phase (plans the reads);
4. **read**, in the background: each handler's background phase; the load
   fails with ``CheckpointChangedError`` if the checkpoint was replaced meanwhile.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
from etils import epath

from checkpointables import (
    _commit,
    _confinement,
    _inflight,
    _step_metrics,
    errors,
    execution,
    handlers,
    layout,
    metadata_checksums,
)
from checkpointables._asyncio import (
    AsyncResponse,
    gather_awaitables,
    run_sync,
    start_background,
    synchronous,
)
from checkpointables.checkpoint_metadata import (
    CHECKPOINT_METADATA_FILE,
    CheckpointMetadata,
    read_checkpoint_metadata,
    recorded_distribution,
)
from checkpointables.context import Context, get_context
from checkpointables.path._parse import as_path
from checkpointables.protocols import Recognizing

T = TypeVar("T")
# What to load: name -> (directory, abstract checkpointable or None).
Items = Mapping[str, tuple[epath.Path, Any]]


# Public as cp.errors.CheckpointableNotFoundError; this name stays for older imports.
CheckpointableNotFoundError = errors.CheckpointableNotFoundError


def _named_as(name: str, available: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, available, n=1)
    return f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)


def held(available: Sequence[str]) -> str:
    """The checkpointables a checkpoint holds, as errors list them."""
    return ", ".join(map(repr, available)) or "no checkpointable"


def checkpointable_not_found(
    path: epath.Path, missing: Sequence[str], available: Sequence[str], what_to_pass: str
) -> errors.CheckpointableNotFoundError:
    """The error for names asked for that checkpoint ``path`` does not hold (every load
    words it alike): what is missing, what it holds, and ``what_to_pass`` instead."""
    names = ", ".join(_named_as(n, available) for n in missing)
    return errors.CheckpointableNotFoundError(
        f"Checkpoint {path} has no checkpointable{'s' if len(missing) > 1 else ''} named "
        f"{names}; it holds {held(available)}. {what_to_pass}"
    )


@attrs.frozen
class Opened:
    """A checkpoint opened for loading: its path, its metadata and its identity."""

    path: epath.Path
    meta: dict[str, Any]
    identity: Any  # See _commit.identity; checked again when the load ends.

    def check_unchanged(self, error: BaseException | None) -> None:
        """Raises ``CheckpointChangedError`` if the checkpoint was replaced since it was opened."""
        _commit.check_unchanged(self.path, self.identity, error)

    def typestr(self, name: str, directory: epath.Path) -> str | None:
        """The handler recorded for checkpointable ``name`` (an Orbax V0 checkpoint records
        one for the whole, flat, directory)."""
        item_handlers = self.meta.get("item_handlers")
        if isinstance(item_handlers, str):
            return item_handlers if directory == self.path else None
        return recorded_typestrs(self.meta).get(name)

    def distribution(self, name: str) -> tuple[str, str | None] | None:
        """The ``(distribution, version)`` recorded for the plugin that saved ``name``."""
        return recorded_distribution(self.meta, name)

    def metadata_of(self, value: Any) -> CheckpointMetadata[Any]:
        """``value`` with the timestamps, custom metadata and metrics of the checkpoint.

        Raises:
          cp.errors.MetadataError, cp.errors.IntegrityError: its metrics item is damaged.
        """
        return CheckpointMetadata(
            self.path,
            metadata=value,
            custom_metadata=self.meta.get("custom_metadata"),
            init_timestamp_nsecs=self.meta.get("init_timestamp_nsecs"),
            commit_timestamp_nsecs=self.meta.get("commit_timestamp_nsecs"),
            metrics=_step_metrics.read(self.path, self.meta),
        )


def open_for_load(path: epath.PathLike, context: Context) -> Opened:
    """Validates ``path`` as a finished checkpoint that stays inside its directory, notes
    which one, reads its metadata."""
    path = as_path(path)
    _inflight.wait_for(path, context.async_options.timeout_secs)
    with context:  # An object store is reached as the context says.
        # The identity first: a replacement after this is noticed when the load ends.
        identity = _commit.identity(path)
        if identity is None or _commit.uses_rename(path) or layout.is_temporary_path(path):
            identity = _validated(path, identity, context.async_options.timeout_secs)
        else:  # Committed on an object store: a partial save's piece has its own marker.
            layout.refuse_partial_piece(path)
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


def _validated(path: epath.Path, identity: Any, timeout_secs: float) -> Any:
    """Checks that ``path`` is a finished checkpoint; returns its identity (``identity``: the
    one read before, ``None`` where nothing was committed then)."""
    try:
        layout.validate_checkpoint_directory(path)
    except errors.NotACheckpointError as e:
        if identity is not None or _commit.uses_rename(path):
            raise
        # On an object store a save may commit, or an overwrite start, while the refusal
        # lists the prefix: look again rather than contradict the listing.
        return _commit.committed_after_refusal(path, e, timeout_secs=timeout_secs)
    if identity is None:  # Committed just now.
        identity = _commit.identity(path)
        _commit.check_unchanged(path, identity, None)
    return identity


def recorded_typestrs(meta: Mapping[str, Any]) -> dict[str, str]:
    """The checkpointables of ``item_handlers``, name -> typestr (empty for flat V0
    checkpoints). Orbax records its metrics item there too; that is not a checkpointable."""
    item_handlers = meta.get("item_handlers")
    if not isinstance(item_handlers, dict):
        return {}
    return {n: t for n, t in item_handlers.items() if n != layout.METRICS_NAME}


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
    distribution: tuple[str, str | None] | None = None,
) -> Any:
    """The handler instance that loads checkpointable ``name`` from ``directory``
    (``distribution``: the one recorded for it, named if its handler is missing)."""
    forced = context.checkpointables_options.handlers.get(name)
    _, instance = handlers.resolve_for_load(
        handlers.registered_handlers(),
        name=name,
        recorded_typestr=recorded,
        abstract=abstract,
        forced=None if forced is None else handlers.get(forced),
        recognizers=_recognizers(directory) if recorded is None else None,
        distribution=distribution,
    )
    return instance


def available_checkpointables(path: epath.Path, meta: Mapping[str, Any]) -> list[str]:
    """The names of the checkpointables stored in checkpoint ``path``, sorted.

    Raises:
      cp.errors.IntegrityError: a checkpointable recorded in ``_CHECKPOINT_METADATA``
        has no directory (Orbax, too, records only what it saved). (A symbolic link that
        loops in its place is named earlier, by ``_confinement``.)
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


def _requested(opened: Opened, abstract_checkpointables: Mapping[str, Any] | None) -> Items:
    """What ``load_checkpointables`` loads: the names asked for (all if none), checked."""
    path = opened.path
    available = available_checkpointables(path, opened.meta)
    # None or {}: everything. (Not `not abstract_checkpointables`: an array has no truth value.)
    if abstract_checkpointables is None or (
        isinstance(abstract_checkpointables, Mapping) and not abstract_checkpointables
    ):
        return {n: (path / n, None) for n in available}
    if isinstance(abstract_checkpointables, CheckpointMetadata):
        abstract_checkpointables = abstract_checkpointables.metadata
    if not isinstance(abstract_checkpointables, Mapping):
        raise errors.InvalidArgumentError(
            "abstract_checkpointables must be a dict of name to abstract checkpointable, got "
            f"{type(abstract_checkpointables).__name__}. To load one pytree use load_pytree: "
            f"cp.load_pytree(path, abstract_pytree), or on a Checkpointer "
            f"ckptr.load_pytree(step, abstract_pytree)."
        )
    missing = [n for n in abstract_checkpointables if n not in available]
    if missing:
        raise checkpointable_not_found(
            path,
            missing,
            available,
            "Pass abstract_checkpointables with keys among those (or None to load them all).",
        )
    return {n: (path / n, a) for n, a in abstract_checkpointables.items()}


async def _named(name: str, directory: epath.Path, awaitable: Any) -> Any:
    try:
        return await awaitable
    except Exception as e:
        e.add_note(f"while loading checkpointable {name!r} from {directory}")
        raise


def _chosen(opened: Opened, context: Context, choose: Callable[[Opened], Items]) -> Items:
    """``choose(opened)``, which fails with ``CheckpointChangedError`` if the checkpoint was
    replaced meanwhile."""
    try:
        with context:
            return choose(opened)
    except Exception as e:
        opened.check_unchanged(e)
        raise


def _blocking_phase(opened: Opened, items: Items, context: Context) -> list[Any]:
    """Runs each handler's blocking phase; returns the awaitables that read."""

    async def blocking() -> list[Any]:
        awaitables = []
        for name, (directory, abstract) in items.items():
            recorded, dist = opened.typestr(name, directory), opened.distribution(name)
            handler = resolve_load_handler(directory, name, recorded, abstract, context, dist)
            awaitables.append(_named(name, directory, handler.load(directory, abstract)))
        return await gather_awaitables(awaitables)

    try:
        with context:  # Handlers read options through get_context().
            return run_sync(blocking())
    except Exception as e:
        opened.check_unchanged(e)
        raise


def _read(opened: Opened, items: Items, reads: list[Any]) -> dict[str, Any]:
    """The background of a load: every read, then the check that nothing replaced the
    checkpoint meanwhile."""
    try:
        named = [_named(n, d, a) for (n, (d, _)), a in zip(items.items(), reads, strict=True)]
        values = run_sync(gather_awaitables(named))
    except Exception as e:
        opened.check_unchanged(e)
        raise
    opened.check_unchanged(None)
    return dict(zip(items, values, strict=True))


@metadata_checksums.scope()  # One lookup of _CHECKSUMS per operation.
def start_load(
    path: epath.PathLike,
    context: Context,
    choose: Callable[[Opened], Items],
    pick: Callable[[dict[str, Any]], T],
) -> AsyncResponse[T]:
    """Loads what ``choose`` picks of the checkpoint at ``path``; returns after the blocking
    phase. The response's value is ``pick`` of ``{name: loaded value}``."""
    with execution.paused_gc():
        opened = open_for_load(path, context)
        items = _chosen(opened, context, choose)
        reads = _blocking_phase(opened, items, context)
        with context:
            return start_background(
                lambda: pick(_read(opened, items, reads)), f"load of {opened.path}", daemon=True
            )


def load_checkpointables_async(
    path: epath.PathLike,
    abstract_checkpointables: Mapping[str, Any] | None = None,
    *,
    context: Context | None = None,
) -> AsyncResponse[dict[str, Any]]:
    """Starts loading checkpointables; reading happens in the background.

    ``abstract_checkpointables`` selects names (a value of ``None`` loads that
    name as saved) and guides each load; ``None`` loads everything.
    """
    return start_load(
        path,
        get_context(context),
        lambda opened: _requested(opened, abstract_checkpointables),
        lambda values: values,
    )


@synchronous(load_checkpointables_async)
def load_checkpointables(
    path: epath.PathLike,
    abstract_checkpointables: Mapping[str, Any] | None = None,
    *,
    context: Context | None = None,
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


def item_metadata(
    directory: epath.Path,
    name: str,
    recorded: str | None,
    context: Context,
    distribution: tuple[str, str | None] | None = None,
) -> Any:
    """The abstract form of one checkpointable, from its handler."""
    instance = resolve_load_handler(directory, name, recorded, None, context, distribution)
    with context:
        return run_sync(instance.metadata(directory))


@metadata_checksums.scope()  # One lookup of _CHECKSUMS per operation.
def checkpointables_metadata(path: epath.PathLike) -> CheckpointMetadata[dict[str, Any]]:
    """What a checkpoint holds: ``.metadata`` maps each name to its abstract form.

    Example::

        meta = cp.checkpointables_metadata(path)
        meta.metadata["pytree"], meta.custom_metadata
    """
    context = get_context()
    opened = open_for_load(path, context)
    items = _chosen(opened, context, lambda opened: _requested(opened, None))
    return opened.metadata_of(
        {
            n: item_metadata(d, n, opened.typestr(n, d), context, opened.distribution(n))
            for n, (d, _) in items.items()
        }
    )
