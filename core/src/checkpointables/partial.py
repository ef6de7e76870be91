"""Partial saves: build one pytree checkpoint from several saves, then publish it.

Example (a state too large to hold at once, saved layer by layer)::

    for i in range(num_layers):
        cp.partial.save(path, {"params": {f"layer{i}": load_layer(i)}})
    cp.partial.save(path, {"step": 1000}, custom_metadata={"run": "exp-7"})
    cp.partial.finalize(path)          # now cp.load_pytree(path) sees everything

How it works. The saves of a session wait for ``finalize`` in the *session*:
``<path>.partial_save/`` on a local disk (a name every reader treats as
temporary, so nothing appears at ``path`` before ``finalize``), ``path``
itself on an object store (a prefix counts as a checkpoint only once its
``commit_success.txt`` exists). Each partial save is an ordinary checkpoint,
written by the normal save path, at ``<session>/pytree/partial-<seq>/``:

- on a local disk it is written as ``<session>/staged-<seq>/`` and renamed
  into place in call order: that rename is its commit, so an interrupted save
  leaves the earlier ones intact and the committed saves are always a prefix
  of the calls;
- on an object store it is written in place, and its own marker commits it.

A staged save's name records its writer (``staged-<seq>-<start ns>-<pid>-<host tag>``; its
``.pending`` twin exists from the call to the commit, so a ``finalize`` elsewhere
sees the save before its files appear, and a save whose path was published
meanwhile fails rather than commit into no checkpoint):
each ``save`` removes those whose process is gone or whose heartbeat is older
than the save timeout (``_leftovers``' rule), and ``finalize`` drops what
interrupted saves left but refuses while another live process's save is among
it. A session keeps a heartbeat (``_Claims``: the one heartbeat machinery of
saves, ``_inflight.Heartbeat``) for what this process has in flight in it: its
staged saves' entries and its ``finalize``, which on a local disk holds a
``finalize.checkpointables-tmp-...`` entry in the session (another process's
``finalize`` refuses while it is fresh) and on an object store the save record
of ``path`` (a cleanup, an overwrite or a ``Checkpointer`` elsewhere leaves it).
``finalize`` then merges the committed saves' custom metadata, asks the pytree
handler (``cp.protocols.Mergeable``) to build ``<session>/pytree/`` from their
pytree directories (its database only references theirs: no array data is
copied, and they stay where they are), and commits the session as ``path``
like any save (a rename of the session directory, or the marker written last).
Every step can be repeated, so a ``finalize`` interrupted at any point is
resumed by calling it again.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

import attrs
from etils import epath

from checkpointables import (
    _commit,
    _enclosing,
    _inflight,
    _leftovers,
    _saving,
    errors,
    layout,
    metadata_checksums,
    multihost,
    storage,
)
from checkpointables._asyncio import AsyncResponse, run_sync, start_background, synchronous
from checkpointables._leftovers import SAVE_RECORD_FILE
from checkpointables._pytree_api import DEFAULT_NAME, pytree_item, pytree_registration
from checkpointables.checkpoint_metadata import (
    CHECKPOINT_METADATA_FILE,
    checkpoint_metadata_json,
    read_checkpoint_metadata,
)
from checkpointables.context import Context, get_context
from checkpointables.path._parse import as_path
from checkpointables.protocols import Mergeable

__all__ = ["save", "save_async", "finalize", "session_path", "SESSION_SUFFIX", "SOURCE_PREFIX"]

SESSION_SUFFIX = ".partial_save"
# A committed partial save inside the session's pytree directory (the core's own name).
SOURCE_PREFIX = "partial-"
_STAGED = "staged-"
_SEQUENCE = re.compile(r"^(?:staged-|partial-)(\d+)")
# A staged save records who writes it: ``staged-<seq>-<start ns>-<pid>-<host tag>`` (the
# primary host's; an older version's name has no host tag). Its modification time is its
# heartbeat while it is in flight (``_Claims``).
# Its ``.pending`` twin exists from the call until the save is committed (or failed): a
# ``finalize`` of another process sees the save running before its files appear.
_STAGED_WRITER = re.compile(r"^staged-\d+-(\d+)-(\d+)(?:-([0-9a-f]+))?(?:\.pending)?$")
# A local finalize's entry in the session (a temporary name: its writer and heartbeat).
_FINALIZING = "finalize"
_PENDING = ".pending"
# What a finalize refused at its commit (``_enclosing.Recheck``) did.
_NOT_FINALIZED = (
    "so the partial saves were not published; they were left in {session}: delete it, and "
    "save them again to a path outside that checkpoint"
)
# How many times finalize merges again for saves that committed while it merged.
_MERGES = 4


def session_path(path: epath.PathLike) -> epath.Path:
    """The directory where the partial saves of ``path`` wait for ``finalize``.

    On object stores that is ``path`` itself (see the module's docstring).
    """
    path = as_path(path)
    if not _commit.uses_rename(path):
        return path
    return path.parent / f"{path.name}{SESSION_SUFFIX}"


class _Claims:
    """What this process has in flight in one session, kept alive by one heartbeat.

    Each claim is a ``SaveTarget`` whose ``claim(again=True)`` is its beat (a local entry's
    ``utime``; an object-store record's GET and PUT), made from the background by an
    ``_inflight.Heartbeat`` every ``_leftovers.beat_interval`` while any claim is held: the
    session beats from its first staged save until its ``finalize`` ends, and an idle
    session (no save in flight: nothing of it can be taken for a leftover) costs nothing.
    The beat refers to the claims alone (paths and options), never to a save's arrays.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # Held while it beats: a released claim is not beaten.
        self._held: dict[int, list[tuple[_commit.SaveTarget, Context]]] = {}
        self._next = 0
        self._heartbeat: _inflight.Heartbeat | None = None

    def hold(self, *targets: _commit.SaveTarget) -> int:
        """Beats ``targets`` from now until ``release`` of the returned key."""
        context = get_context()
        with self._lock:
            self._next += 1
            self._held[self._next] = [(target, context) for target in targets]
            if self._heartbeat is None:
                interval = _leftovers.beat_interval(context.async_options.timeout_secs)
                beat = functools.partial(_beat_claims, self._held, self._lock)
                self._heartbeat = _inflight.Heartbeat(beat, interval)
            return self._next

    def release(self, key: int) -> None:
        """Stops beating what ``hold`` returned ``key`` for: no beat of it runs once this
        returns (the last claim stops the heartbeat)."""
        with self._lock:
            self._held.pop(key, None)
            heartbeat = None if self._held else self._heartbeat
            if heartbeat is not None:
                self._heartbeat = None
        if heartbeat is not None:
            heartbeat.stop()


def _beat_claims(
    held: dict[int, list[tuple[_commit.SaveTarget, Context]]], lock: threading.Lock
) -> None:
    """One beat of a session's claims; the first failure is raised (and logged) once all
    were tried."""
    error = None
    with lock:
        for target, context in [claim for claims in held.values() for claim in claims]:
            try:
                with context:  # An object store's storage is configured by the context.
                    target.claim(again=True)
            except Exception as e:
                error = error or e
    if error is not None:
        raise error


class _SessionState:
    """What this process knows about one session: the last sequence number and save, and
    what it has in flight there (``_Claims``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.last_sequence = 0
        self.last_save: AsyncResponse[None] | None = None
        self.claims = _Claims()


_states_lock = threading.Lock()
_states: dict[str, _SessionState] = {}


def _state(session: epath.Path) -> _SessionState:
    with _states_lock:
        return _states.setdefault(storage.key(session), _SessionState())


def _names(directory: epath.Path) -> list[str]:
    return [e.name for e in storage.list_dir(directory)]


def _sequence(name: str) -> int | None:
    match = _SEQUENCE.match(name)
    return int(match.group(1)) if match else None


def _next_sequence(session: epath.Path, state: _SessionState, operation: str) -> tuple[int, str]:
    """A number no save of the session used, not even one that failed, and who writes the
    save (``<start ns>-<pid>-<host tag>`` of the primary host): the same on every process."""
    used = [state.last_sequence]
    if multihost.is_primary_host():
        names = _names(session) + _names(session / DEFAULT_NAME)
        used += [s for s in map(_sequence, names) if s is not None]
    chosen = f"{max(used) + 1} {time.time_ns()}-{os.getpid()}-{layout.host_tag()}"
    sequence, writer = multihost.broadcast_from_primary(f"{operation}/seq", chosen).split()
    state.last_sequence = int(sequence)
    return state.last_sequence, writer


def _writer(name: str) -> tuple[int, int, str] | None:
    """``(start ns, pid, host)`` of the process that writes session entry ``name`` (a staged
    save, a save's temporary directory or a finalize's entry; ``_leftovers.name_host``), or
    ``None`` if its name records none."""
    match = _STAGED_WRITER.match(name)
    if match:
        tag = match.group(3)
        here = tag is None or tag == layout.host_tag()
        return int(match.group(1)), int(match.group(2)), _leftovers.this_host() if here else ""
    parsed = layout.parse_temporary_name(name)
    return None if parsed is None else (parsed[1], parsed[2], _leftovers.name_host(name))


def _writer_gone(name: str, session: epath.Path, *, own_done: bool) -> bool | None:
    """Whether the writer of session entry ``name`` is provably gone (``_leftovers``' rule:
    its single-process job's process is gone from this host, or its heartbeat, the entry's
    modification time, is older than the save timeout, whatever the host); ``own_done``
    answers for this process's own entries. ``None``: the name records no writer."""
    writer = _writer(name)
    if writer is None:
        return None
    started_ns, pid, host = writer
    if pid == os.getpid() and host:  # This process's own.
        return own_done
    timeout = get_context().async_options.timeout_secs
    if _STAGED_WRITER.match(name) is None:
        return _leftovers.is_abandoned(name, timeout_secs=timeout, directory=session)
    try:  # One lstat. Gone meanwhile: its start counts (removing nothing is harmless).
        alive_ns: int | None = max(os.lstat(os.fspath(session / name)).st_mtime_ns, started_ns)
    except OSError:
        alive_ns = None
    return _leftovers.is_over(started_ns, pid, host, timeout, time.time_ns(), alive_ns)


def _remove_dead_writers(session: epath.Path) -> None:
    """Removes what the saves of processes now gone left in a local session: staged saves
    never promoted, temporary directories. Their committed saves stay (they resume)."""
    for name in _names(session):
        if _writer_gone(name, session, own_done=False):
            storage.remove_tree(session / name)


def _check_not_finished(path: epath.Path) -> None:
    if layout.is_temporary_path(path):
        raise errors.InvalidArgumentError(
            f"{path} has a temporary directory's name; choose another path."
        )
    # On an object store the session is the path itself: only a commit there is in the way.
    if _commit.occupied(path):
        what = "a finished checkpoint" if layout.is_checkpoint(path) else "something"
        raise errors.CheckpointExistsError(
            f"{path} already holds {what}; a partial save never replaces it. Delete it first, or "
            f"choose another path."
        )
    _enclosing.refuse_inside(path)


def _promote(path: epath.Path, staged: epath.Path, target: epath.Path) -> None:
    """Commits a staged partial save (local disks): renamed into the session's pytree
    directory, unless ``path`` was finalized meanwhile (by another process, which did not
    see this save): its data would be in no checkpoint."""
    if _commit.occupied(path):
        storage.remove_tree(staged)
        raise errors.CheckpointExistsError(
            f"{path} was finalized while this partial save ran, without it: its data is in no "
            f"checkpoint. Finalize once every save has returned; save it to another path."
        )
    try:  # A checkpoint committed at a parent of ``path`` since this save's start looked.
        _enclosing.Recheck(path).now()
    except errors.InvalidArgumentError:
        storage.remove_tree(staged)
        raise
    os.makedirs(os.fspath(target.parent), exist_ok=True)
    layout.rename_durably(staged, target)


def _end_pending(pending: epath.Path | None, session: epath.Path, *, failed: bool) -> None:
    """Removes a save's ``.pending`` entry (if it made one), and the session if the save
    failed and left it empty. Only ``os.rmdir``: it removes an empty directory or fails
    (``epath``'s ``rmdir`` would raise ``ValueError`` over a session holding earlier saves,
    hiding the save's own error, and deletes by listing first, which is not atomic)."""
    if pending is None:
        return
    with contextlib.suppress(OSError):
        os.rmdir(pending)
        if failed:
            os.rmdir(os.fspath(session))  # Only if empty (local sessions: ``pending`` is).


def _mark_pending(staged: epath.Path) -> epath.Path:
    """Makes the ``.pending`` twin of ``staged`` (see ``_STAGED_WRITER``); returns it."""
    pending = staged.parent / f"{staged.name}{_PENDING}"
    os.makedirs(os.fspath(pending), exist_ok=True)
    return pending


def _entry(final: epath.Path, entry: epath.Path) -> _commit.SaveTarget:
    """A local session entry as a claim: its beat sets its modification time (one ``utime``;
    nothing once it is gone)."""
    return _commit.RenameTarget(final, entry, overwrite=False)


def _end_claim(claims: _Claims, key: int | None) -> None:
    if key is not None:
        claims.release(key)


def _start_staged(
    staged: epath.Path, item: Any, custom_metadata: Mapping[str, Any] | None, *, in_place: bool
) -> AsyncResponse[None]:
    """Starts the ordinary save of a partial save at ``staged``. Its start's look for an
    enclosing checkpoint is ``_check_not_finished``'s; its commit's is ``_promote``'s on a
    local disk (renaming it into the session commits it), the save's own on an object store
    (``in_place``: its marker commits it)."""
    forced = {DEFAULT_NAME: pytree_registration().handler_cls}
    request = _saving.SaveRequest(
        staged, item, custom_metadata, forced_handlers=forced, inside_checked=not in_place
    )
    return _saving.start(request)


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
      cp.errors.InvalidArgumentError: ``path`` lies inside a finished checkpoint.
      ValueError: ``pytree`` is None, or ``custom_metadata`` is not a JSON object.
      cp.errors.NoHandlerForObjectError: some leaves cannot be saved.
    """
    path = as_path(path)
    item = pytree_item(DEFAULT_NAME, pytree)
    _check_not_finished(path)
    session = session_path(path)
    state = _state(session)
    with state.lock:
        operation = f"partial/{multihost.next_operation_id()}"
        sequence, writer = _next_sequence(session, state, operation)
        target = session / DEFAULT_NAME / f"{SOURCE_PREFIX}{sequence:06d}"
        in_place = not _commit.uses_rename(path)  # Committed where finalize needs it.
        staged = target if in_place else session / f"{_STAGED}{sequence:06d}-{writer}"
        pending, claim = None, None
        if multihost.is_primary_host() and not in_place:
            _remove_dead_writers(session)
            pending = _mark_pending(staged)
            # Beaten until it ends: a save waiting for earlier ones is not taken for dead.
            claim = state.claims.hold(_entry(staged, pending), _entry(target, staged))
        try:
            inner = _start_staged(staged, item, custom_metadata, in_place=in_place)
        except BaseException:
            _end_claim(state.claims, claim)
            _end_pending(pending, session, failed=True)
            raise
        previous = state.last_save
        claims = state.claims  # Not the state: the background refers to no more than needed.

        def commit_in_order() -> None:
            if previous is not None:
                previous.exception()  # Its error stays with its response.
            error = None
            try:
                inner.result()
                if pending is not None:
                    _promote(path, staged, target)
            except BaseException as e:
                error = e
            _end_claim(claims, claim)
            _end_pending(pending, session, failed=error is not None)
            multihost.sync_global_processes(f"{operation}/committed", error=error)

        state.last_save = start_background(commit_in_order, f"partial save {sequence} of {path}")
        return state.last_save


@synchronous(save_async)
def save(
    path: epath.PathLike, pytree: Any, *, custom_metadata: Mapping[str, Any] | None = None
) -> None:
    """Adds ``pytree`` to the partial checkpoint of ``path`` and waits until it is committed.

    See ``save_async``. Example::

        cp.partial.save(path, {"params": {"layer0": w0}})
        cp.partial.save(path, {"params": {"layer1": w1}, "step": 7})
        cp.partial.finalize(path)
    """


def finalize(path: epath.PathLike) -> None:
    """Publishes the partial saves of ``path`` as one ordinary pytree checkpoint at ``path``.

    Waits for this process's partial saves still running. An interrupted
    ``finalize`` is resumed by calling it again. Array data is not copied: the
    checkpoint's database refers to the partial saves' data files.

    Raises:
      FileExistsError: ``path`` already holds a checkpoint (or anything else), or
        another process, still alive, is writing a partial save of ``path``.
      FileNotFoundError: no partial save of ``path`` was committed.
    """
    path = as_path(path)
    session = session_path(path)
    state = _state(session)
    with state.lock:
        if state.last_save is not None:
            state.last_save.exception()  # Its error stays with its response.
        operation = f"partial/{multihost.next_operation_id()}"
        error: BaseException | None = None
        try:
            _check_not_finished(path)
        except BaseException as e:
            error = e
        # Every process looks before the primary publishes: a slow one would see the
        # finished checkpoint and take it for someone else's.
        multihost.sync_global_processes(f"{operation}/checked", error=error)
        if multihost.is_primary_host():
            try:
                _finalize(path, session, state.claims)
            except BaseException as e:
                error = e
        multihost.sync_global_processes(f"{operation}/finalized", error=error)
        state.last_save = None


@attrs.frozen
class _Source:
    """A committed partial save: its pytree directory, and its ``_CHECKPOINT_METADATA``."""

    pytree: epath.Path
    meta: dict[str, Any]


def _finalize(path: epath.Path, session: epath.Path, claims: _Claims) -> None:
    """The primary host's ``finalize``: claim, clean, merge, commit (each step repeatable),
    beating its claim until the commit (``_Claims``)."""
    target = _commit.target_for(path, session, overwrite=False, assembled=True)
    _check_session_exists(path, session)
    local = _commit.uses_rename(path)
    # Locally its entry is made before the session is looked at: of two finalizes, at least
    # one sees the other's entry (and refuses) before it cleans what the other builds.
    entry = layout.temporary_path_for(session / _FINALIZING) if local else None
    if entry is not None:
        os.mkdir(os.fspath(entry))  # Not makedirs: a session published meanwhile stays gone.
    key = claims.hold(_entry(session, entry)) if entry is not None else None
    failed = True
    try:
        sources = _committed_sources(path, session, keep=entry)
        if entry is None:
            target.claim()
            key = claims.hold(target)
        text = _merge_sources(path, session, sources)
        failed = False
    finally:  # No beat may follow: the commit deletes the record, publishes the session.
        _end_claim(claims, key)
        if entry is not None:
            with contextlib.suppress(OSError):
                os.rmdir(os.fspath(entry))
        elif failed:
            _drop_own_record(session)
    # A checkpoint committed at a parent of ``path`` since ``finalize`` looked stops the commit.
    check = _enclosing.Recheck(path, outcome=_NOT_FINALIZED.format(session=session))
    target.publish(
        {layout.MARKER_FILE: "", CHECKPOINT_METADATA_FILE: text}, _commit.marker(path), check
    )


def _drop_own_record(session: epath.Path) -> None:
    """Removes this process's record from an object-store session whose ``finalize`` failed
    before its commit: another ``finalize`` would take it for one still running until its
    heartbeat (stopped) grew older than the timeout. One GET (and a DELETE)."""
    with contextlib.suppress(Exception):  # The finalize's own error is the one to raise.
        record = _leftovers.read_record(session)
        own = (os.getpid(), _leftovers.this_host())
        if record is not None and (record.pid, record.host) == own:
            storage.remove_file(session / SAVE_RECORD_FILE)


def _merge_sources(path: epath.Path, session: epath.Path, sources: dict[int, _Source]) -> str:
    """Merges the committed partial saves (and those that commit meanwhile) into the session's
    pytree directory; returns the text of its ``_CHECKPOINT_METADATA``."""
    for _ in range(_MERGES):
        ordered = [sources[s] for s in sorted(sources)]
        meta = _merged_metadata(ordered)
        _merge_pytrees([s.pytree for s in ordered], session / DEFAULT_NAME)
        # Another process's save may have committed while this merged (it saw no finished
        # path): merged too, or its data would be in no checkpoint. One still running (its
        # `.pending` entry) stops the publish.
        _refuse_running(path, session)
        added = _sources_added(session, sources)
        if not added:
            break
        sources.update(added)
    else:
        raise _still_running(path, session / DEFAULT_NAME)
    registration = pytree_registration()
    dist = registration.distribution
    return checkpoint_metadata_json(
        item_handlers={DEFAULT_NAME: registration.typestr},
        custom_metadata=meta["custom_metadata"],
        init_timestamp_nsecs=meta["init_timestamp_nsecs"] or time.time_ns(),
        commit_timestamp_nsecs=time.time_ns(),
        distributions={DEFAULT_NAME: (dist, registration.version)} if dist else None,
    )


def _refuse_running(path: epath.Path, session: epath.Path) -> list[str]:
    """The session's entries besides its pytree directory, once none is a save of another
    live process (else raises ``_still_running``)."""
    names = [n for n in _names(session) if n != DEFAULT_NAME]
    running = [n for n in names if _writer_gone(n, session, own_done=True) is False]
    if running:
        raise _still_running(path, session / running[0])
    return names


def _check_session_exists(path: epath.Path, session: epath.Path) -> None:
    if _commit.uses_rename(session) and not session.is_dir():
        raise errors.CheckpointNotFoundError(
            f"No partial save session for {path}: {session} does not exist. Call "
            f"cp.partial.save({str(path)!r}, ...) first."
        )


def _sources_added(session: epath.Path, known: Mapping[int, _Source]) -> dict[int, _Source]:
    """The committed partial saves of the session not in ``known`` (by sequence number)."""
    pytree_dir = session / DEFAULT_NAME
    added = {}
    for name in _names(pytree_dir):
        sequence, source = _sequence(name), pytree_dir / name
        if sequence is not None and sequence not in known and _is_committed(source):
            added[sequence] = _read_source(session, source)
    return added


def _is_committed(source: epath.Path) -> bool:
    """Whether ``source`` (a ``partial-<seq>`` entry) is a committed partial save: on a local
    disk its rename committed it (only temporary names were never renamed), on an object
    store its commit marker."""
    if layout.is_temporary_path(source):
        return False
    if _commit.uses_rename(source):
        return storage.is_dir(source)
    return storage.is_file(source / layout.COMMIT_SUCCESS_FILE)


def _read_source(session: epath.Path, source: epath.Path) -> _Source:
    """A committed partial save, its metadata files checked against its ``_CHECKSUMS`` (as a
    load checks them) so that damage is reported naming it, before anything is merged.

    Raises:
      cp.errors.IntegrityError: it lost its ``_CHECKPOINT_METADATA`` (it is committed, so
        dropping it would publish a checkpoint without its keys), or a metadata file does
        not match its checksum.
    """
    problems = metadata_checksums.verify(source)
    # Not layout.is_checkpoint: that answers False for a piece of a partial save, by design.
    if not problems and not storage.is_file(source / CHECKPOINT_METADATA_FILE):
        problems = [f"{source / CHECKPOINT_METADATA_FILE} is missing"]
    if problems:
        found = "; ".join(p.rstrip(". ") for p in problems)
        raise errors.IntegrityError(
            f"Cannot finalize the partial saves in {session}: {source} is a committed partial "
            f"save, and it is damaged: {found}. finalize never drops a committed save (the "
            f"checkpoint would lack its keys). Restore {source} from a copy, or delete {session} "
            f"and make the partial saves again (to give up only its keys instead, delete {source} "
            f"and save them anew)."
        )
    return _Source(source / DEFAULT_NAME, read_checkpoint_metadata(source))


def _committed_sources(
    path: epath.Path, session: epath.Path, keep: epath.Path | None = None
) -> dict[int, _Source]:
    """The committed partial saves, by sequence number; removes everything else in the session
    but ``keep`` (interrupted saves never happened; what an interrupted finalize built is
    built again), unless a save or finalize of another process, still running, is among it
    (on an object store, a finalize's is the record of ``path``: one GET where there is one)."""
    names = _refuse_running(path, session)
    if SAVE_RECORD_FILE in names and _record_running(_leftovers.read_record(session)):
        raise _still_running(path, session / SAVE_RECORD_FILE)
    for name in names:
        if keep is None or name != keep.name:
            storage.remove_tree(session / name)
    pytree_dir = session / DEFAULT_NAME
    sources: dict[int, _Source] = {}
    for name in _names(pytree_dir):
        source, sequence = pytree_dir / name, _sequence(name)
        if sequence is not None and _is_committed(source):
            sources[sequence] = _read_source(session, source)
        elif sequence is not None and not _commit.uses_rename(source):
            if _record_running(_leftovers.read_record(source)):
                raise _still_running(path, source)
            _leftovers.remove_unfinished(source)  # An interrupted save: it never happened.
        else:  # What an interrupted finalize built, or a temporary name never renamed.
            storage.remove_tree(source)
    if not sources:
        raise errors.CheckpointNotFoundError(
            f"No committed partial save of {path} (they failed, were interrupted, or none was "
            f"made). Call cp.partial.save({str(path)!r}, ...) first."
        )
    return sources


def _record_running(record: _leftovers.SaveRecord | None) -> bool:
    """Whether an unfinished object-store partial save may still be running elsewhere."""
    if record is None or (record.pid == os.getpid() and record.host == _leftovers.this_host()):
        return False  # No record proves nothing runs; this process's own saves are done.
    timeout = get_context().async_options.timeout_secs
    return not record.is_abandoned(timeout_secs=timeout)


def _still_running(path: epath.Path, entry: epath.Path) -> errors.CheckpointExistsError:
    if entry.name == SAVE_RECORD_FILE or entry.name.startswith(f"{_FINALIZING}."):
        return errors.CheckpointExistsError(
            f"Cannot finalize {path}: another process is finalizing it, or saving to it "
            f"({entry} is its mark; its process is alive and its heartbeat is younger than "
            f"AsyncOptions.timeout_secs). Wait for that process to finish: a finalize publishes "
            f"{path}; if it fails instead, call finalize again."
        )
    return errors.CheckpointExistsError(
        f"Cannot finalize {path}: {entry} is a partial save that another process is still "
        f"writing (its process is alive and its heartbeat is younger than "
        f"AsyncOptions.timeout_secs). Wait for that process's partial saves to finish (their "
        f"responses' result()), then call finalize again."
    )


def _merge_json(base: Any, update: Any) -> Any:
    """``update`` over ``base``: objects merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(update, dict):
        merged = dict(base)
        for key, value in update.items():
            merged[key] = _merge_json(base.get(key), value)
        return merged
    return update


def _merged_metadata(sources: list[_Source]) -> dict[str, Any]:
    """The custom metadata (merged, later saves win) and first start time of the saves."""
    meta: dict[str, Any] = {"custom_metadata": {}, "init_timestamp_nsecs": None}
    for saved in (s.meta for s in sources):
        meta["custom_metadata"] = _merge_json(
            meta["custom_metadata"], saved.get("custom_metadata") or {}
        )
        init = saved.get("init_timestamp_nsecs")
        if isinstance(init, int):
            meta["init_timestamp_nsecs"] = min(meta["init_timestamp_nsecs"] or init, init)
    return meta


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
