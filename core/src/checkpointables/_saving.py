"""``save_checkpointables`` and its async form: the one save path of the library.

Every save (the free functions, ``cp.partial``, the training Checkpointer) is a
``SaveRequest`` handed to ``start``, which runs four phases:

1. **validate**: names, metadata, handlers; nothing is written yet;
2. **stage**: the primary host checks the path, picks where the save writes
   (a temporary sibling, or the object-store prefix itself) and tells the others;
3. **blocking**: each handler's blocking phase (copies device data to host);
   ``start`` returns after it;
4. **write and commit**, in the background: each handler's background phase,
   then, once every process is done, the primary host commits (``_commit``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from etils import epath

from checkpointables import (
    _commit,
    _enclosing,
    _inflight,
    _leftovers,
    _os_errors,
    _step_metrics,
    _user_paths,
    errors,
    execution,
    handlers,
    layout,
    multihost,
    options,
    safe_json,
    storage,
)
from checkpointables import reuse as reuse_lib
from checkpointables import staging as staging_lib
from checkpointables._asyncio import (
    AsyncResponse,
    gather_awaitables,
    run_sync,
    start_background,
    synchronous,
)
from checkpointables.checkpoint_metadata import CHECKPOINT_METADATA_FILE, checkpoint_metadata_json
from checkpointables.context import Context, get_context
from checkpointables.path import PathAwaitingCreation
from checkpointables.path._parse import as_path
from checkpointables.protocols import Finalizable

__all__ = ["SaveRequest", "start", "save_checkpointables", "save_checkpointables_async"]


def overwrite_flag(value: Any) -> bool:
    """``overwrite`` as a bool, checked (``cp.options.checked_bool``)."""
    return options.checked_bool(value, "overwrite")


@attrs.frozen
class SaveRequest:
    """One save, as the front doors describe it.

    Attributes:
      path: the checkpoint to write.
      checkpointables: name -> object.
      custom_metadata: JSON stored in ``_CHECKPOINT_METADATA``.
      overwrite: replace what is at ``path``.
      metrics: JSON metrics stored with it (the training Checkpointer's).
      forced_handlers: name -> the handler class that saves it, whatever resolution says
        (``save_pytree`` forces the pytree handler); the context's choice still wins.
      context: the options; ``None``: the context in force.
      replace_unfinished: replace an object-store save that did not finish even if it may
        be running (the Checkpointer, sole writer of its root).
      reuse: a committed checkpoint to take unchanged data from (``reuse_from``), or the
        ``cp.reuse.SaveReuse`` to hand the handlers (the Checkpointer's); ``None``: none.
      staging: where the handlers report the host memory they staged (the Checkpointer's,
        for ``last_save_stats``); ``None``: a new one.
      inside_checked: the caller looks for a finished checkpoint enclosing ``path``
        itself, at the start and before the commit (``cp.partial`` on a local disk, for
        the user's path its staged saves lie under): neither the save's start nor its
        commit looks at its parents.
    """

    path: epath.PathLike
    checkpointables: Mapping[str, Any]
    custom_metadata: Mapping[str, Any] | None = None
    # Checked as the request is made: a truthy "no" must not replace a checkpoint.
    overwrite: bool = attrs.field(default=False, converter=overwrite_flag)
    metrics: Mapping[str, Any] | None = None
    forced_handlers: Mapping[str, type] | None = None
    context: Context | None = None
    replace_unfinished: bool = False
    reuse: reuse_lib.SaveReuse | epath.PathLike | None = None
    staging: staging_lib.SaveStaging | None = None
    inside_checked: bool = False


@attrs.frozen
class _Checked:
    """A request after validation: what every later phase needs."""

    path: epath.Path
    checkpointables: Mapping[str, Any]
    handlers: dict[str, tuple[str, Any]]  # name -> (typestr, handler instance)
    distributions: dict[str, tuple[str, str | None]]  # name -> its handler's plugin's distribution
    custom_metadata: dict[str, Any]
    metrics: dict[str, Any]
    context: Context
    primary: bool
    operation: str  # The save's name among the processes' collective operations.
    inside_checked: bool  # SaveRequest's: its commit does not look at the parents again.
    reuse: reuse_lib.SaveReuse | None = None
    staging: staging_lib.SaveStaging = attrs.field(factory=staging_lib.SaveStaging)
    init_ns: int = attrs.field(factory=time.time_ns)


def json_or_raise(value: Any, what: str) -> dict[str, Any]:
    """``value`` (``None``: ``{}``) as a dict, checked to be JSON before anything is written."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise errors.InvalidArgumentError(f"{what} must be a dict, got {type(value).__name__}.")
    # NumPy/JAX scalars become Python numbers here, so every later writer (the step's
    # _CHECKPOINT_METADATA, a Checkpointer's root metadata) gets plain JSON.
    return safe_json.to_json_value(dict(value), what=what)


def resolve_save_handlers(
    checkpointables: Mapping[str, Any], context: Context, forced: Mapping[str, type] | None = None
) -> dict[str, tuple[str, Any]]:
    """Maps each name to ``(typestr, handler instance)``; raises before anything is written."""
    registrations = handlers.registered_handlers()
    chosen = {}
    for name, obj in checkpointables.items():
        choice = context.checkpointables_options.handlers.get(name) or (forced or {}).get(name)
        registration, instance = handlers.resolve_for_save(
            registrations, obj, name=name, forced=None if choice is None else handlers.get(choice)
        )
        chosen[name] = (
            registration.typestr if registration else handlers.typestr(type(instance)),
            instance,
        )
    return chosen


def handler_distributions(
    chosen: Mapping[str, tuple[str, Any]],
) -> dict[str, tuple[str, str | None]]:
    """Maps each name to the ``(distribution, version)`` that installed the plugin of its
    handler, for those that one did (not ``register_handler``'s)."""
    by_class = {r.handler_cls: r for r in handlers.registered_handlers()}
    result = {}
    for name, (_, instance) in chosen.items():
        registration = by_class.get(type(instance))
        if registration is not None and registration.distribution is not None:
            result[name] = (registration.distribution, registration.version)
    return result


def _validate(request: SaveRequest) -> _Checked:
    """Checks everything that can be checked before anything is written."""
    context = get_context(request.context)
    path = _commit.resolve_final(as_path(request.path))
    layout.validate_checkpointables_dict(request.checkpointables)
    _user_paths.check_name_lengths(path, request.checkpointables)
    if layout.is_temporary_path(path):
        raise errors.InvalidArgumentError(
            f"{path} has a temporary directory's name; choose another path."
        )
    chosen = resolve_save_handlers(request.checkpointables, context, request.forced_handlers)
    reuse = request.reuse
    if reuse is not None and not isinstance(reuse, reuse_lib.SaveReuse):
        with context:  # An object store's source is reached with the context's settings.
            reuse = reuse_lib.SaveReuse(reuse_lib.checked_source(reuse, path))
    return _Checked(
        path=path,
        checkpointables=request.checkpointables,
        custom_metadata=json_or_raise(request.custom_metadata, "custom_metadata"),
        metrics=json_or_raise(request.metrics, "metrics"),
        handlers=chosen,
        distributions=handler_distributions(chosen),
        context=context,
        primary=multihost.is_primary_host(context),
        # Every process must write to the same place: the primary names it.
        operation=f"save/{multihost.next_operation_id()}"
        if multihost.is_coordinated(context)
        else "",
        inside_checked=request.inside_checked,
        reuse=reuse,
        staging=request.staging or staging_lib.SaveStaging(),
    )


def _stage(save: _Checked, request: SaveRequest) -> _commit.SaveTarget:
    """Checks the path may be written, and picks where the save writes (the same on every
    process)."""
    timeout = save.context.async_options.timeout_secs
    _inflight.wait_for(save.path, timeout)
    with save.context:  # The storage of an object store is configured by the context.
        found = _commit.clear_to_save(
            save.path,
            overwrite=request.overwrite,
            replace_unfinished=request.replace_unfinished,
            timeout_secs=timeout,
            operation=save.operation,
            not_inside=not request.inside_checked,
        )
        root = multihost.broadcast_from_primary(
            f"{save.operation}/tmp",
            str(_commit.write_root_for(save.path)) if save.primary else None,
            context=save.context,
        )
        return _commit.target_for(
            save.path,
            epath.Path(root),
            overwrite=request.overwrite,
            found=found,
            in_own_root=request.replace_unfinished,
        )


def _directory(save: _Checked, target: _commit.SaveTarget) -> PathAwaitingCreation:
    """The save's root, created (with its parents and a directory per checkpointable) when a
    handler first awaits it, or before the background phases at the latest: an async save
    whose handlers do not await it returns without touching the file system."""

    def create() -> None:
        error = None
        if save.primary:
            try:
                timeout = save.context.async_options.timeout_secs
                storage.make_dirs(save.path.parent)
                _leftovers.remove(
                    _leftovers.abandoned_entries([save.path.parent], timeout_secs=timeout)
                )
                target.create(save.checkpointables, save.context.file_options.path_permission_mode)
                _start_heartbeat(save, target)
            except OSError as e:
                error = e
        multihost.sync_global_processes(
            f"{save.operation}/created", error=error, context=save.context
        )

    return PathAwaitingCreation(target.root, create)


# The heartbeats of the saves of this process still writing, by their target (``_leftovers``).
_heartbeats: dict[_commit.SaveTarget, _inflight.Heartbeat] = {}


def _start_heartbeat(save: _Checked, target: _commit.SaveTarget) -> None:
    """Starts the heartbeat that tells other processes this save (created just now) is alive:
    ``target.claim(again=True)`` every ``_leftovers.beat_interval``, from the background."""

    context = save.context  # Not the save: its beat must not keep the tree's arrays alive.

    def beat() -> None:
        with context:  # An object store's storage is configured by the context.
            target.claim(again=True)

    interval = _leftovers.beat_interval(save.context.async_options.timeout_secs)
    _heartbeats[target] = _inflight.Heartbeat(beat, interval)


def _stop_heartbeat(target: _commit.SaveTarget) -> None:
    """Stops the save's heartbeat (if it has one): no beat runs once this returns."""
    heartbeat = _heartbeats.pop(target, None)
    if heartbeat is not None:
        heartbeat.stop()


def _blocking_phase(save: _Checked, directory: PathAwaitingCreation) -> list[Any]:
    """Runs every handler's blocking phase; returns their background phases."""

    async def blocking() -> list[Any]:
        return await gather_awaitables(
            [
                instance.save(directory / name, save.checkpointables[name])
                for name, (_, instance) in save.handlers.items()
            ]
        )

    # Handlers read options, what they may reuse, and where they report what they staged.
    with (
        save.context,
        reuse_lib.active(save.reuse),
        staging_lib.active(save.staging),
        _os_errors.translated(f"saving {save.path}"),
    ):
        return run_sync(blocking())


def _write(directory: PathAwaitingCreation, background: list[Any]) -> None:
    """Creates the directory (if no handler did), then runs the handlers' background phases."""
    try:
        directory.create_now()
    finally:
        # Run even if the creation failed: each handler then fails where it awaits
        # the directory, and cleans up what it started.
        run_sync(gather_awaitables([a for a in background if a is not None]))


def _commit_save(save: _Checked, target: _commit.SaveTarget) -> None:
    """The primary host's commit: handlers' finalization, then the metadata, then the marker."""
    for name, (_, instance) in save.handlers.items():
        if isinstance(instance, Finalizable):
            run_sync(instance.finalize(target.root / name))
    metadata = checkpoint_metadata_json(
        item_handlers={name: ts for name, (ts, _) in save.handlers.items()},
        custom_metadata=save.custom_metadata,
        metrics=save.metrics,
        init_timestamp_nsecs=save.init_ns,
        commit_timestamp_nsecs=time.time_ns(),
        distributions=save.distributions,
        # This process's (the primary's): each process reports its own to its Checkpointer.
        performance_metrics=save.staging.performance_metrics(),
    )
    files = {layout.MARKER_FILE: "", CHECKPOINT_METADATA_FILE: metadata}
    files.update(_step_metrics.files_for(save.metrics))  # Where Orbax reads metrics.
    # A parent may have become a checkpoint while the save wrote (another process's).
    check = None if save.inside_checked else _enclosing.Recheck(save.path)
    if isinstance(target, _commit.MarkerTarget):
        # Before the commit: a beat must not bring back the record the commit deletes. A
        # local save beats on through the flush of its files (a long one, for a large save);
        # a beat after the rename finds nothing at the temporary name (or, after a swap, the
        # replaced checkpoint, being deleted).
        _stop_heartbeat(target)
    target.publish(files, _commit.marker(save.path), check)
    # A check of this process that ran while the save wrote may have found its path clear.
    _enclosing.forget(save.path)


def _write_and_commit(
    save: _Checked,
    target: _commit.SaveTarget,
    directory: PathAwaitingCreation,
    background: list[Any],
) -> None:
    """The background of a save: every process writes, then the primary alone commits, and
    nobody returns before the checkpoint is visible (or the save failed everywhere)."""

    def sync(phase: str, error: BaseException | None, report: str = "") -> dict[int, str]:
        return multihost.sync_global_processes(
            f"{save.operation}/{phase}", error=error, report=report, context=save.context
        )

    with _os_errors.translated(f"saving {save.path}"):
        try:
            error = _error_of(lambda: _write(directory, background))
            # A handler's write into a deleted temporary directory: say that, not its file.
            error = None if error is None else target.explained(error)
            reused = save.reuse.bytes_reused if save.reuse is not None else 0
            reports = sync("written", error, str(reused))
            if save.reuse is not None:  # The checkpoint's, as bytes_written: every process's.
                save.reuse.bytes_reused = sum(int(n) for n in reports.values())
            sync(
                "committed", _error_of(lambda: _commit_save(save, target)) if save.primary else None
            )
        except BaseException as e:
            _discard(save, target, e)
            raise
        finally:
            _stop_heartbeat(target)


def _error_of(work: Callable[[], object]) -> BaseException | None:
    """Runs ``work()``; returns what it raised (to report to the other processes), or ``None``."""
    try:
        work()
    except BaseException as e:
        return e
    return None


def _discard(save: _Checked, target: _commit.SaveTarget, error: BaseException) -> None:
    """Removes what a failed save wrote, unless storage stopped answering: asking again would
    cost the caller another whole timeout before the error is raised (what was written is a
    leftover the next save or Checkpointer removes)."""
    unanswered = isinstance(error, errors.StorageError) and isinstance(
        error.__cause__, TimeoutError
    )
    _stop_heartbeat(target)  # What is left is a leftover (or deleted) now.
    if save.primary and not unanswered:
        with save.context, contextlib.suppress(Exception):
            target.discard()


def start(request: SaveRequest) -> AsyncResponse[None]:
    """Starts the save ``request`` describes; returns after the blocking phase.

    The GC is paused from the start; the pause ends on the background thread.
    Ending it here would make the caller pay, right before returning, the
    collection that the first allocation after the pause triggers (15 ms for
    5,000 leaves with JAX imported).

    Raises what ``save_checkpointables_async`` raises.
    """
    pause = contextlib.ExitStack()
    pause.enter_context(execution.paused_gc())
    try:
        save = _validate(request)
        target = _stage(save, request)
        directory = _directory(save, target)
        try:
            background = _blocking_phase(save, directory)
        except BaseException as e:
            explained = target.explained(e)  # Before the discard, which deletes the directory.
            _discard(save, target, e)
            if explained is e:
                raise
            raise explained from e

        def write_and_commit() -> None:
            pause.close()
            _write_and_commit(save, target, directory, background)

        with save.context:
            response = start_background(write_and_commit, f"save of {save.path}")
    except BaseException:
        pause.close()
        raise
    _inflight.track(save.path, response)
    return response


def save_checkpointables_async(
    path: epath.PathLike,
    checkpointables: Mapping[str, Any],
    *,
    overwrite: bool = False,
    custom_metadata: Mapping[str, Any] | None = None,
    reuse_from: epath.PathLike | None = None,
) -> AsyncResponse[None]:
    """Saves several checkpointables into one checkpoint; returns after the blocking phase.

    Each checkpointable goes to ``path/<name>/`` through the handler chosen for
    it (see ``cp.handlers``). Nothing counts as a checkpoint at ``path`` until
    every handler finished and the checkpoint is committed (see ``_commit``).
    ``reuse_from``: a committed checkpoint; each checkpointable may take what did not
    change from the one of the same name there (``reuse_from/<name>``; a pytree whose
    name is not there, from its only pytree: ``docs/incremental.md``).

    Raises (before anything is written):
      ValueError: a bad name, an empty dict, or metadata that is not JSON.
      FileExistsError: ``path`` exists and ``overwrite`` is false.
      cp.errors.InvalidArgumentError: ``path`` lies inside a finished checkpoint.
      FileNotFoundError, cp.errors.NotACheckpointError: ``reuse_from`` is not a committed
        checkpoint.
      cp.errors.NameTooLongError: a name is too long for the filesystem.
      cp.errors.NoHandlerForObjectError: no handler accepts an object.
    Raises (by the response, after a failed write): cp.errors.DiskFullError, ...
    """
    return start(SaveRequest(path, checkpointables, custom_metadata, overwrite, reuse=reuse_from))


@synchronous(save_checkpointables_async)
def save_checkpointables(
    path: epath.PathLike,
    checkpointables: Mapping[str, Any],
    *,
    overwrite: bool = False,
    custom_metadata: Mapping[str, Any] | None = None,
    reuse_from: epath.PathLike | None = None,
) -> None:
    """Saves several checkpointables into one checkpoint and waits until it is committed.

    ``reuse_from``: an earlier committed checkpoint to link unchanged arrays from (see
    ``save_checkpointables_async``).

    Example::

        cp.save_checkpointables(path, {"pytree": state, "dataset": iterator},
                                custom_metadata={"run": "exp-7"})
    """
