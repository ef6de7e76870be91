"""Partial saves: build one pytree checkpoint from several saves, then publish it.

Example (a state too large to hold at once, saved layer by layer)::

    for i in range(num_layers):
        cp.partial.save(path, {"params": {f"layer{i}": load_layer(i)}})
    cp.partial.save(path, {"step": 1000}, custom_metadata={"run": "exp-7"})
    cp.partial.finalize(path)          # now cp.load_pytree(path) sees everything

How it works. The session lives in ``<path>.partial_save/`` (a name every
reader treats as temporary, so nothing appears at ``path`` before
``finalize``). Each save is an ordinary checkpoint written by the normal save
path into ``staged-<seq>/`` and then renamed to ``pending-<seq>/``: that
rename is its commit, done in call order, so an interrupted save leaves the
earlier ones intact and the committed saves are always a prefix of the calls.

``finalize`` folds each pending save into the session in sequence order (its
custom metadata merged into the session's ``_CHECKPOINT_METADATA``, then its
pytree directory renamed to ``pytree/ocdbt.partial_<seq>/``, then the rest
removed), asks the pytree handler to build the final pytree from those
directories (its database only references theirs: no array data is copied),
and renames the session directory to ``path``. Every step can be repeated, so
a ``finalize`` (or a ``save``) interrupted at any point is resumed by calling
it again.

On object stores, which cannot rename, the session lives at ``path`` itself
(``path`` counts as a checkpoint only once its ``commit_success.txt`` exists):
each partial save is an ordinary checkpoint committed at
``path/pytree/ocdbt.partial_<seq>/`` (its own marker is its commit), and
``finalize`` builds ``path/pytree/`` from the committed ones, writes
``_CHECKPOINT_METADATA`` and commits ``path`` with its marker, last. Partial
saves that were interrupted are deleted by ``finalize``; an interrupted
``finalize`` is resumed by calling it again.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

from etils import epath

from checkpointables import _commit, _saving, errors, layout, metadata_checksums, multihost, storage
from checkpointables._asyncio import AsyncResponse, run_sync, start_background, waiting_caller
from checkpointables._pytree_api import DEFAULT_NAME, pytree_registration
from checkpointables.checkpoint_metadata import (
    CHECKPOINT_METADATA_FILE,
    checkpoint_metadata_json,
    read_checkpoint_metadata,
)
from checkpointables.metadata_checksums import CHECKSUMS_FILE
from checkpointables.path._parse import as_path
from checkpointables.protocols import Mergeable

__all__ = ["save", "save_async", "finalize", "session_path", "SESSION_SUFFIX"]

SESSION_SUFFIX = ".partial_save"
_STAGED, _PENDING = "staged-", "pending-"
# In the session's pytree directory: one moved pytree directory per partial save.
_PARTIAL_PREFIX = "ocdbt.partial_"
_SEQUENCE = re.compile(r"^(?:staged-|pending-|ocdbt\.partial_)(\d+)")


def session_path(path: epath.PathLike) -> epath.Path:
    """The directory where the partial saves of ``path`` wait for ``finalize``.

    On object stores that is ``path`` itself (see the module's docstring).
    """
    path = as_path(path)
    if not _commit.uses_rename(path):
        return path
    return path.parent / f"{path.name}{SESSION_SUFFIX}"


class _SessionState:
    """What this process knows about one session: the last sequence number and save."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.last_sequence = 0
        self.last_save: AsyncResponse[None] | None = None


_states_lock = threading.Lock()
_states: dict[str, _SessionState] = {}


def _state(session: epath.Path) -> _SessionState:
    key = os.path.abspath(os.fspath(session))
    with _states_lock:
        return _states.setdefault(key, _SessionState())


def _sequences(session: epath.Path) -> list[int]:
    """Every sequence number used in ``session`` (staged, pending or already folded)."""
    names = _names(session) + _names(session / DEFAULT_NAME)
    return [int(m.group(1)) for m in map(_SEQUENCE.match, names) if m]


def _names(directory: epath.Path) -> list[str]:
    return [e.name for e in storage.list_dir(directory)]


def _check_not_finished(path: epath.Path) -> None:
    if layout.is_temporary_path(path):
        raise errors.InvalidArgumentError(
            f"{path} has a temporary directory's name; choose another path."
        )
    if not _commit.uses_rename(path):
        if layout.is_checkpoint(path):  # Anything else there is this session's.
            raise errors.CheckpointExistsError(
                f"{path} already holds a finished checkpoint; a partial save never replaces it. "
                f"Delete it first, or choose another path."
            )
        return
    if path.exists():
        what = "a finished checkpoint" if layout.is_checkpoint(path) else "something"
        raise errors.CheckpointExistsError(
            f"{path} already holds {what}; a partial save never replaces it. Delete it first, or "
            f"choose another path."
        )


def _fsync_directory(directory: epath.Path) -> None:
    fd = os.open(os.fspath(directory), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename_durably(source: epath.Path, target: epath.Path) -> None:
    os.rename(os.fspath(source), os.fspath(target))
    _fsync_directory(target.parent)


def save_async(
    path: epath.PathLike, pytree: Any, *, custom_metadata: Mapping[str, Any] | None = None
) -> AsyncResponse[None]:
    """Adds ``pytree`` to the partial checkpoint of ``path``; returns once data is on the host.

    Keys not saved before are added; keys saved before are replaced (a leaf
    may replace a subtree and a subtree a leaf; lists merge by index).
    ``custom_metadata`` is merged into the session's (later values win). The
    saves of one session commit in call order: each waits for the previous
    one in the background. Nothing appears at ``path`` until ``finalize``.

    Raises (before anything is written):
      FileExistsError: ``path`` already holds a checkpoint (or anything else).
      ValueError: ``pytree`` is None, or ``custom_metadata`` is not a JSON object.
      cp.errors.NoHandlerForObjectError: some leaves cannot be saved.
    """
    path = as_path(path)
    if pytree is None:
        raise errors.InvalidArgumentError("The pytree to save is None; there is nothing to save.")
    _check_not_finished(path)
    session = session_path(path)
    state = _state(session)
    handler_cls = pytree_registration().handler_cls
    primary = multihost.is_primary_host()
    with state.lock:
        # Numbers are never reused, not even those of saves that failed or were interrupted.
        local = max([state.last_sequence, *(_sequences(session) if primary else [])]) + 1
        operation = f"partial/{multihost.next_operation_id()}"
        sequence = int(multihost.broadcast_from_primary(f"{operation}/seq", str(local)))
        state.last_sequence = sequence
        previous = state.last_save
        in_place = not _commit.uses_rename(path)
        if in_place:  # Committed where finalize needs it: nothing to move later.
            staged = session / DEFAULT_NAME / f"{_PARTIAL_PREFIX}{sequence:06d}"
        else:
            staged = session / f"{_STAGED}{sequence:06d}"
        try:
            inner = _saving.save_checkpointables_async(
                staged,
                {DEFAULT_NAME: pytree},
                custom_metadata=custom_metadata,
                forced_handlers={DEFAULT_NAME: handler_cls},
            )
        except BaseException:
            if primary and not in_place:
                with contextlib.suppress(OSError):
                    session.rmdir()  # Only if this failed save left it empty.
            raise

        def commit() -> None:
            if previous is not None:
                previous.exception()  # In call order; its error stays with its response.
            error = None
            try:
                inner.result()
                if primary and not in_place:  # The commit: the staged checkpoint joins.
                    _rename_durably(staged, session / f"{_PENDING}{sequence:06d}")
            except BaseException as e:
                error = e
            multihost.sync_global_processes(f"{operation}/committed", error=error)

        response = start_background(commit, f"partial save {sequence} of {path}")
        state.last_save = response
    return response


def save(
    path: epath.PathLike, pytree: Any, *, custom_metadata: Mapping[str, Any] | None = None
) -> None:
    """Adds ``pytree`` to the partial checkpoint of ``path`` and waits until it is committed.

    See ``save_async``. Example::

        cp.partial.save(path, {"params": {"layer0": w0}})
        cp.partial.save(path, {"params": {"layer1": w1}, "step": 7})
        cp.partial.finalize(path)
    """
    with waiting_caller():
        response = save_async(path, pytree, custom_metadata=custom_metadata)
    response.result()


def _merge_json(base: Any, update: Any) -> Any:
    """``update`` over ``base``: objects merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(update, dict):
        merged = dict(base)
        for key, value in update.items():
            merged[key] = _merge_json(base.get(key), value)
        return merged
    return update


def _write_metadata(session: epath.Path, meta: Mapping[str, Any], commit_ns: int) -> None:
    """Replaces the session's ``_CHECKPOINT_METADATA`` in one atomic step."""
    text = checkpoint_metadata_json(
        item_handlers=meta["item_handlers"],
        custom_metadata=meta["custom_metadata"],
        init_timestamp_nsecs=meta["init_timestamp_nsecs"],
        commit_timestamp_nsecs=commit_ns,
    )
    scratch = session / f"{CHECKPOINT_METADATA_FILE}.tmp"
    layout.write_file_durably(scratch, text)
    _rename_durably(scratch, session / CHECKPOINT_METADATA_FILE)


def _merge_saved_metadata(meta: dict[str, Any], saved: Mapping[str, Any]) -> None:
    """Folds one partial save's ``_CHECKPOINT_METADATA`` into the session's ``meta``."""
    meta["custom_metadata"] = _merge_json(
        meta["custom_metadata"], saved.get("custom_metadata") or {}
    )
    handlers = saved.get("item_handlers")
    if isinstance(handlers, dict) and handlers.get(DEFAULT_NAME):
        meta["item_handlers"] = {DEFAULT_NAME: handlers[DEFAULT_NAME]}
    init = saved.get("init_timestamp_nsecs")
    if isinstance(init, int):
        meta["init_timestamp_nsecs"] = min(meta["init_timestamp_nsecs"] or init, init)


def _fold_pending(session: epath.Path, meta: dict[str, Any]) -> None:
    """Moves every pending save into the session's pytree directory, oldest first.

    Each step is repeatable: after a crash, calling this again finishes the job.
    """
    pytree_dir = session / DEFAULT_NAME
    pending = sorted(
        (p for p in session.iterdir() if p.name.startswith(_PENDING)), key=lambda p: p.name
    )
    for directory in pending:
        sequence = int(_SEQUENCE.match(directory.name).group(1))  # type: ignore[union-attr]
        moved = pytree_dir / f"{_PARTIAL_PREFIX}{sequence:06d}"
        if (directory / DEFAULT_NAME).exists():
            _merge_saved_metadata(meta, read_checkpoint_metadata(directory))
            # The metadata first: once the pytree moves, this save's metadata is gone.
            _write_metadata(session, meta, time.time_ns())
            pytree_dir.mkdir(exist_ok=True)
            _rename_durably(directory / DEFAULT_NAME, moved)
        elif not moved.exists():
            raise errors.CheckpointError(
                f"Partial save {directory} has no {DEFAULT_NAME}/ directory and was not folded "
                f"into {pytree_dir}: the session is damaged. Delete {session} and save again."
            )
        layout.remove_tree(directory)


def _session_metadata(session: epath.Path) -> dict[str, Any]:
    """What earlier (interrupted) finalize calls already folded into the session."""
    try:
        saved = read_checkpoint_metadata(session)
    except FileNotFoundError:
        saved = {}
    handlers = saved.get("item_handlers")
    return {
        "item_handlers": handlers
        if isinstance(handlers, dict) and handlers
        else {DEFAULT_NAME: pytree_registration().typestr},
        "custom_metadata": saved.get("custom_metadata") or {},
        "init_timestamp_nsecs": saved.get("init_timestamp_nsecs"),
    }


def _remove_leftovers(session: epath.Path) -> None:
    """Deletes what interrupted saves and finalize calls left in the session."""
    for child in session.iterdir():
        name = child.name
        if name.startswith(_STAGED) or layout.is_temporary_path(child) or name.endswith(".tmp"):
            layout.remove_tree(child)  # Never committed: those saves did not happen.
    pytree_dir = session / DEFAULT_NAME
    if pytree_dir.exists():
        for child in pytree_dir.iterdir():
            if not child.name.startswith(_PARTIAL_PREFIX):
                # Built by an interrupted finalize: rebuilt below.
                if child.is_dir():
                    layout.remove_tree(child)
                else:
                    child.unlink()
    for name in (layout.MARKER_FILE, layout.COMMIT_SUCCESS_FILE, CHECKSUMS_FILE):
        (session / name).unlink(missing_ok=True)


def _merge_pytrees(sources: list[epath.Path], pytree_dir: epath.Path) -> None:
    """Builds ``pytree_dir`` from the partial saves' pytree directories ``sources``."""
    registration = pytree_registration()
    handler = registration.handler_cls()
    if not isinstance(handler, Mergeable):
        raise errors.PluginError(
            f"The pytree handler {registration.typestr} (plugin {registration.plugin}) cannot "
            f"merge partial saves: it is not a cp.protocols.Mergeable (no merge_partial method). "
            f"Upgrade checkpointables-pytree."
        )
    run_sync(handler.merge_partial(sources, pytree_dir))


def finalize(path: epath.PathLike) -> None:
    """Publishes the partial saves of ``path`` as one ordinary pytree checkpoint at ``path``.

    Waits for this process's partial saves still running. An interrupted
    ``finalize`` is resumed by calling it again. Array data is not copied: the
    checkpoint's database refers to the partial saves' data files.

    Raises:
      FileExistsError: ``path`` already holds a checkpoint (or anything else).
      FileNotFoundError: no partial save of ``path`` was committed.
    """
    path = as_path(path)
    session = session_path(path)
    state = _state(session)
    with state.lock:
        if state.last_save is not None:
            state.last_save.exception()  # Its error stays with its response.
        _check_not_finished(path)
        operation = f"partial/{multihost.next_operation_id()}"
        error: BaseException | None = None
        if multihost.is_primary_host():
            try:
                if _commit.uses_rename(path):
                    _finalize_session(path, session)
                else:
                    _finalize_in_place(path)
            except BaseException as e:
                error = e
        multihost.sync_global_processes(f"{operation}/finalized", error=error)
        state.last_save = None


def _finalize_session(path: epath.Path, session: epath.Path) -> None:
    if not session.is_dir():
        raise errors.CheckpointNotFoundError(
            f"No partial save session for {path}: {session} does not exist. Call "
            f"cp.partial.save({str(path)!r}, ...) first."
        )
    _remove_leftovers(session)
    meta = _session_metadata(session)
    _fold_pending(session, meta)
    pytree_dir = session / DEFAULT_NAME
    if not pytree_dir.is_dir() or not any(
        p.name.startswith(_PARTIAL_PREFIX) for p in pytree_dir.iterdir()
    ):
        raise errors.CheckpointNotFoundError(
            f"The partial save session {session} holds no committed partial save (they failed or "
            f"were interrupted). Call cp.partial.save({str(path)!r}, ...) again."
        )
    sources = sorted(
        (p for p in pytree_dir.iterdir() if p.name.startswith(_PARTIAL_PREFIX)),
        key=lambda p: p.name,
    )
    _merge_pytrees(sources, pytree_dir)
    if meta["init_timestamp_nsecs"] is None:
        meta["init_timestamp_nsecs"] = time.time_ns()
    (session / layout.MARKER_FILE).touch()
    (session / layout.COMMIT_SUCCESS_FILE).write_text(f"Checkpoint commit was successful to {path}")
    _write_metadata(session, meta, time.time_ns())
    metadata_checksums.record(session)
    layout.fsync_tree(session)
    layout.commit(session, path, overwrite=False)


def _finalize_in_place(path: epath.Path) -> None:
    """``finalize`` on an object store: build ``path/pytree`` from the committed partial saves.

    Every step can be repeated: what an interrupted call built is rebuilt.
    """
    pytree_dir = path / DEFAULT_NAME
    parts = sorted(n for n in _names(pytree_dir) if n.startswith(_PARTIAL_PREFIX))
    committed = [n for n in parts if layout.is_checkpoint(pytree_dir / n)]
    for name in parts:
        if name not in committed:
            _commit.remove_unfinished(pytree_dir / name)  # Interrupted: never happened.
    if not committed:
        raise errors.CheckpointNotFoundError(
            f"No committed partial save of {path} (they failed, were interrupted, or none was "
            f"made). Call cp.partial.save({str(path)!r}, ...) first."
        )
    # What an interrupted finalize built beside the partial saves is built again.
    for entry in storage.list_dir(pytree_dir):
        if not entry.name.startswith(_PARTIAL_PREFIX):
            storage.remove_tree(pytree_dir / entry.name)
    for entry in storage.list_dir(path):
        if entry.name != DEFAULT_NAME:
            storage.remove_tree(path / entry.name)
    meta: dict[str, Any] = {
        "item_handlers": {DEFAULT_NAME: pytree_registration().typestr},
        "custom_metadata": {},
        "init_timestamp_nsecs": None,
    }
    for name in committed:
        _merge_saved_metadata(meta, read_checkpoint_metadata(pytree_dir / name))
    _merge_pytrees([pytree_dir / n / DEFAULT_NAME for n in committed], pytree_dir)
    storage.write_text(path / layout.MARKER_FILE, "")
    storage.write_text(
        path / CHECKPOINT_METADATA_FILE,
        checkpoint_metadata_json(
            item_handlers=meta["item_handlers"],
            custom_metadata=meta["custom_metadata"],
            init_timestamp_nsecs=meta["init_timestamp_nsecs"] or time.time_ns(),
            commit_timestamp_nsecs=time.time_ns(),
        ),
    )
    metadata_checksums.record(path)
    storage.write_text(
        path / layout.COMMIT_SUCCESS_FILE,
        f"Checkpoint commit was successful to {path}\n{time.time_ns()}\n",
    )
