"""``save_checkpointables`` and its async form: the one save path of the library."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any

from etils import epath

from checkpointables import (
    _commit,
    _inflight,
    _os_errors,
    _user_paths,
    errors,
    execution,
    handlers,
    layout,
    multihost,
    safe_json,
    storage,
)
from checkpointables._asyncio import (
    AsyncResponse,
    caller_waits,
    gather_awaitables,
    run_sync,
    start_background,
    waiting_caller,
)
from checkpointables.checkpoint_metadata import CHECKPOINT_METADATA_FILE, checkpoint_metadata_json
from checkpointables.context import Context, get_context
from checkpointables.path import PathAwaitingCreation
from checkpointables.path._parse import as_path
from checkpointables.protocols import Finalizable


def _json_or_raise(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise errors.InvalidArgumentError(f"{what} must be a dict, got {type(value).__name__}.")
    safe_json.dumps_checked(value, what=what)
    return dict(value)


def _forced_handler(context: Context, name: str) -> type | None:
    forced = context.checkpointables_options.handlers.get(name)
    return None if forced is None else handlers.get(forced)


def resolve_save_handlers(
    checkpointables: Mapping[str, Any], context: Context, forced: Mapping[str, type] | None = None
) -> dict[str, tuple[str, Any]]:
    """Maps each name to ``(typestr, handler instance)``; raises before anything is written."""
    registrations = handlers.registered_handlers()
    chosen = {}
    for name, obj in checkpointables.items():
        forced_cls = _forced_handler(context, name) or (forced or {}).get(name)
        registration, instance = handlers.resolve_for_save(
            registrations, obj, name=name, forced=forced_cls
        )
        chosen[name] = (
            registration.typestr if registration else handlers.typestr(type(instance)),
            instance,
        )
    return chosen


def save_checkpointables_async(
    path: epath.PathLike,
    checkpointables: Mapping[str, Any],
    *,
    overwrite: bool = False,
    custom_metadata: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    forced_handlers: Mapping[str, type] | None = None,
    context: Context | None = None,
    replace_unfinished: bool = False,
) -> AsyncResponse[None]:
    """Saves several checkpointables into one checkpoint; returns after the blocking phase.

    Each checkpointable goes to ``path/<name>/`` through the handler chosen for
    it (see ``cp.handlers``). Nothing counts as a checkpoint at ``path`` until
    every handler finished and the checkpoint is committed (see ``_commit``).
    ``replace_unfinished`` (for the Checkpointer, sole writer of its root)
    replaces an object-store save that did not finish even if it may be running.

    Raises (before anything is written):
      ValueError: a bad name, an empty dict, or metadata that is not JSON.
      FileExistsError: ``path`` exists and ``overwrite`` is false.
      cp.errors.NameTooLongError: a name is too long for the filesystem.
      cp.errors.NoHandlerForObjectError: no handler accepts an object.
    Raises (by the response, after a failed write): cp.errors.DiskFullError, ...
    """
    context = get_context(context)
    path = _commit.resolve_final(as_path(path))
    layout.validate_checkpointables_dict(checkpointables)
    _user_paths.check_name_lengths(path, checkpointables)
    custom = _json_or_raise(custom_metadata, "custom_metadata")
    metric_values = _json_or_raise(metrics, "metrics")
    timeout = context.async_options.timeout_secs
    _inflight.wait_for(path, timeout)
    if layout.is_temporary_path(path):
        raise errors.InvalidArgumentError(
            f"{path} has a temporary directory's name; choose another path."
        )
    chosen = resolve_save_handlers(checkpointables, context, forced_handlers)
    init_ns = time.time_ns()
    primary = multihost.is_primary_host(context)
    # Every process must write to the same place: the primary names it.
    operation = f"save/{multihost.next_operation_id()}" if multihost.is_coordinated(context) else ""
    with context:  # The storage of an object store is configured by the context.
        _commit.check_can_save(
            path,
            overwrite=overwrite,
            replace_unfinished=replace_unfinished,
            timeout_secs=timeout,
            operation=operation,
        )
    if primary:
        with _os_errors.translated(f"saving {path}"):
            storage.make_dirs(path.parent)
    root = epath.Path(
        multihost.broadcast_from_primary(
            f"{operation}/tmp",
            str(_commit.write_root_for(path)) if primary else None,
            context=context,
        )
    )
    with context:  # The target keeps the storage the context configures.
        target = _commit.target_for(path, root, overwrite=overwrite, timeout_secs=timeout)
    mode = context.file_options.path_permission_mode

    def create_directories() -> None:
        error = None
        if primary:
            try:
                target.create(checkpointables, mode)
            except OSError as e:
                error = e
        multihost.sync_global_processes(f"{operation}/created", error=error, context=context)

    directory = PathAwaitingCreation(root, create_directories)

    async def blocking_phase() -> list[Any]:
        return await gather_awaitables(
            [
                instance.save(directory / name, checkpointables[name])
                for name, (_, instance) in chosen.items()
            ]
        )

    def discard() -> None:
        if primary:
            with contextlib.suppress(Exception):
                target.discard()

    try:
        with context, _os_errors.translated(f"saving {path}"):  # Handlers read get_context().
            background_awaitables = run_sync(blocking_phase())
    except BaseException:
        discard()
        raise

    def commit() -> None:
        for name, (_, instance) in chosen.items():
            if isinstance(instance, Finalizable):
                run_sync(instance.finalize(root / name))
        metadata = checkpoint_metadata_json(
            item_handlers={name: ts for name, (ts, _) in chosen.items()},
            custom_metadata=custom,
            metrics=metric_values,
            init_timestamp_nsecs=init_ns,
            commit_timestamp_nsecs=time.time_ns(),
        )
        target.publish(
            {layout.MARKER_FILE: "", CHECKPOINT_METADATA_FILE: metadata},
            marker=f"Checkpoint commit was successful to {path}\n{time.time_ns()}\n",
        )

    def background() -> None:
        with _os_errors.translated(f"saving {path}"):
            write_and_commit()

    def write_and_commit() -> None:
        error: BaseException | None = None
        try:
            try:
                directory.create_now()
            finally:
                # Run even if the creation failed: each handler then fails where it awaits
                # the directory, and cleans up what it started.
                run_sync(gather_awaitables([a for a in background_awaitables if a is not None]))
        except BaseException as e:
            error = e
        try:
            # Every process finished writing (or one failed, and all fail) ...
            multihost.sync_global_processes(f"{operation}/written", error=error, context=context)
            error = None
            if primary:
                try:
                    commit()  # ... then the primary alone commits ...
                except BaseException as e:
                    error = e
            # ... and nobody returns before the checkpoint is visible.
            multihost.sync_global_processes(f"{operation}/committed", error=error, context=context)
        except BaseException:
            discard()
            raise

    with context:
        # A synchronous save's caller waits for the commit anyway: write on its thread.
        response = start_background(background, f"save of {path}", inline=caller_waits())
    _inflight.track(path, response)
    return response


def save_checkpointables(
    path: epath.PathLike,
    checkpointables: Mapping[str, Any],
    *,
    overwrite: bool = False,
    custom_metadata: Mapping[str, Any] | None = None,
) -> None:
    """Saves several checkpointables into one checkpoint and waits until it is committed.

    Example::

        cp.save_checkpointables(path, {"pytree": state, "dataset": iterator},
                                custom_metadata={"run": "exp-7"})
    """
    with waiting_caller(), execution.paused_gc():
        response = save_checkpointables_async(
            path, checkpointables, overwrite=overwrite, custom_metadata=custom_metadata
        )
    response.result()
