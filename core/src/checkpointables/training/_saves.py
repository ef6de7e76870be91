"""A Checkpointer's saves: one in flight at a time, each decided, checked, written, recorded.

A save runs through named phases:

1. **decide**: the save decision policy (every process makes the same saves:
   in a multi-process job the primary decides);
2. **validate**: the arguments, before waiting for anything;
3. **stage**: wait for the previous save, then check the step may be written
   (and, for an overwrite, let loads of the old step finish);
4. **write**: an ordinary save of the step (``_saving``);
5. **commit**: once committed, the step is recorded, its cost logged, and
   the retention policy consulted; a failure is kept to be raised by the next
   front door unless the caller saw it through the response.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import functools
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import attrs
from etils import epath

from checkpointables import (
    _commit,
    _confinement,
    _pytree_api,
    _saving,
    errors,
    layout,
    multihost,
    options,
    storage,
)
from checkpointables import reuse as reuse_lib
from checkpointables import staging as staging_lib
from checkpointables._asyncio import AsyncResponse, completed
from checkpointables.context import Context
from checkpointables.training import _listing, _metrics, _readers, _save_stats
from checkpointables.training import save_decision_policies as decision_lib
from checkpointables.training._listing import StepIndex
from checkpointables.training._retention import Retention
from checkpointables.training._worker import BackgroundErrors
from checkpointables.training.errors import StepAlreadyExistsError
from checkpointables.training.step_info import StepInfo

logger = logging.getLogger(__name__)


class SaveResponse(AsyncResponse[bool]):
    """A save's response; an error seen through it is not raised again by the Checkpointer."""

    def __init__(self, description: str, errors: BackgroundErrors) -> None:
        super().__init__(description)
        self._errors = errors

    def result(self, timeout: float | None = None) -> bool:
        """Waits for the commit; True once committed. Re-raises a background failure."""
        error = self.exception(timeout)
        if error is not None:
            raise error
        return bool(self._value)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Waits like ``result`` and returns the background error, or ``None``."""
        error = super().exception(timeout)
        if error is not None:
            self._errors.mark_reported(error)
        return error


def _force_flag(value: Any) -> bool:
    return options.checked_bool(value, "force")


@attrs.frozen
class StepSave:
    """What a front door asks: save ``checkpointables`` as ``step``."""

    step: int
    checkpointables: Mapping[str, Any]
    # Checked as the front door is called, also for a step the policy skips.
    force: bool = attrs.field(default=False, converter=_force_flag)
    overwrite: bool = attrs.field(default=False, converter=_saving.overwrite_flag)
    metrics: Mapping[str, Any] | None = None
    custom_metadata: Mapping[str, Any] | None = None
    pytree_name: str | None = None  # Saved by the pytree handler (``save_pytree``).


class Saves:
    """The saves of one Checkpointer (see the module's docstring)."""

    def __init__(
        self,
        path_of: Any,
        policy: decision_lib.SaveDecisionPolicy,
        steps: StepIndex,
        retention: Retention,
        errors: BackgroundErrors,
    ) -> None:
        self._path_of = path_of  # step -> its directory
        self._policy = policy
        self._steps = steps
        self._retention = retention
        self._errors = errors
        self._lock = threading.Lock()
        self._in_flight: tuple[int, AsyncResponse[bool]] | None = None
        self.last_stats: _save_stats.SaveStats | None = None
        # (on, frozen): whether saves reuse the newest step's unchanged arrays (``reuse``).
        self.reuse: tuple[bool, Any] = (False, None)

    def in_progress(self) -> bool:
        """Whether a save has started and not yet committed (or failed)."""
        with self._lock:
            return self._in_flight is not None and not self._in_flight[1].done()

    def wait(self, timeout: float, step: int | None = None) -> None:
        """Waits for the save in flight (of ``step``, if given); its error stays pending
        (unless the caller saw it through the response)."""
        with self._lock:
            in_flight = self._in_flight
        if in_flight is not None and step in (None, in_flight[0]):
            AsyncResponse.exception(in_flight[1], timeout)

    def decide(self, step: int, context: Context) -> bool:
        """Whether the policy saves ``step`` now (the primary's answer, on every process)."""
        candidate = StepInfo(step=step, path=self._path_of(step))
        in_progress = decision_lib.DecisionContext(is_saving_in_progress=self.in_progress())
        decision = bool(
            self._policy.should_save(candidate, self._steps.sorted(), context=in_progress)
        )
        if multihost.is_coordinated(context):
            # Time- and progress-based policies can disagree between processes;
            # every process must make the same saves, so the primary decides.
            key = f"training/should_save/{multihost.next_operation_id()}"
            shared = multihost.broadcast_from_primary(key, str(int(decision)), context=context)
            decision = shared == "1"
        return decision

    def start(
        self, request: StepSave, context: Context, decided: bool | None = None
    ) -> AsyncResponse[bool]:
        """Runs the phases of the module's docstring; returns after the blocking phase
        (``decided``: the policy's answer for the step, if the caller asked already)."""
        started = time.perf_counter()
        self._errors.raise_pending()
        chosen = self.decide(request.step, context) if decided is None else decided
        if not request.force and not chosen:
            return completed(False, f"skipped save of step {request.step}")
        layout.validate_checkpointables_dict(request.checkpointables)
        metrics = _metrics.to_json(request.metrics)
        forced = None
        if request.pytree_name is not None:
            forced = {request.pytree_name: _pytree_api.pytree_registration().handler_cls}
        self.wait(context.async_options.timeout_secs)
        self._errors.raise_pending()
        # Before the step is looked at: a removal by this Checkpointer's worker of what is
        # there (a leftover, a dropped step) must not run while the save writes there.
        self._retention.claim(self._path_of(request.step), context.async_options.timeout_secs)
        path = self._check_step(request, context)
        reuse, lease = self._reuse_source(request.step, context)
        staging = staging_lib.SaveStaging()
        try:
            inner = _saving.start(
                _saving.SaveRequest(
                    path,
                    request.checkpointables,
                    request.custom_metadata,
                    request.overwrite,
                    metrics,
                    forced,
                    context,
                    # This root's only writer: an unfinished save at the step was interrupted.
                    replace_unfinished=True,
                    reuse=reuse,
                    staging=staging,
                    # Not ``inside_checked``: a checkpoint committed at a parent of the root
                    # since it was opened (``open_root``) stops the save as a free function's
                    # (looked for at its start and again at its commit; see ``_enclosing``).
                )
            )
        except BaseException:
            self._end_lease(lease)
            raise
        if lease is not None:  # The source step stays until the save ends (committed or not).
            inner.add_done_callback(lambda _: self._end_lease(lease))
        return self._track(request, path, metrics, inner, started, context, reuse, staging)

    def _end_lease(self, lease: str | None) -> None:
        """Releases the lease on a save's source step; a deletion it deferred may now run."""
        if lease is not None:
            _readers.release(lease)
            self._retention.after_read()

    def _reuse_source(
        self, step: int, context: Context
    ) -> tuple[reuse_lib.SaveReuse | None, str | None]:
        """What the save of ``step`` may reuse: the newest committed step (``_source_step``),
        leased (like a step being read: retention defers deleting it) until the save ends."""
        on, frozen = self.reuse
        if not on:
            return None, None
        latest = self._source_step(step)
        if latest is None:
            return reuse_lib.SaveReuse(None, frozen), None
        lease = _readers.acquire(latest.path)
        if not _commit.uses_rename(latest.path):
            # An object store: its commit marker says whether the step is still there (it
            # holds no links or pipes), and which commit it is: what the pytree handler read
            # of it after that commit (``after_commit``) is used only if it is the same. Read
            # while the save's own checks run (``SaveReuse.source_identity`` waits for it).
            identity = _identity_pool().submit(
                contextvars.copy_context().run, _identity_in, context, latest.path
            )
            return reuse_lib.SaveReuse(latest.path, frozen, identity), lease
        with context:
            # Deleted meanwhile (another process's retention), or holding what a load would
            # refuse (a link out of the step): nothing is taken from it; write everything.
            usable = storage.exists(latest.path) and _contained(latest.step, latest.path)
        if not usable:
            _readers.release(lease)
            return reuse_lib.SaveReuse(None, frozen), None
        return reuse_lib.SaveReuse(latest.path, frozen), lease

    def _source_step(self, step: int) -> StepInfo | None:
        """The step a save of ``step`` reuses from: the newest committed one, even when it is
        ``step`` itself (an overwrite of the newest step) where the storage renames: the new
        step is written in a temporary directory and swapped in at its commit, so the old
        one stays whole until then, and the files linked from it outlive its removal (hard
        links: other names of the same files). On an object store an overwrite deletes the
        old step's objects as it starts: the newest other committed step instead."""
        latest = self._steps.latest()
        if latest is None or latest.step != step or _commit.uses_rename(latest.path):
            return latest
        others = [info for info in self._steps.sorted() if info.step != step]
        return others[-1] if others else None

    def refuse_existing(self, request: StepSave, context: Context) -> None:
        """Raises what ``start`` would raise before saving anything: an earlier save's
        error, or ``StepAlreadyExistsError`` for a step that exists (unless overwritten)."""
        self._errors.raise_pending()
        if not request.overwrite:
            self._refuse_existing(request.step, context)

    def _refuse_existing(self, step: int, context: Context) -> None:
        path = self._path_of(step)
        known = self._steps.get(step) is not None
        with context:
            occupied = _commit.occupied(path)
        if known or occupied:
            raise StepAlreadyExistsError(
                f"Step {step} already exists: {path} holds {_occupant(known, path, context)}. "
                f"Pass overwrite=True to replace it (the old one stays until the new one "
                f"commits), or save another step."
            )

    def _check_step(self, request: StepSave, context: Context) -> epath.Path:
        """The step's directory, once nothing in it may be lost by the save."""
        path = self._path_of(request.step)
        if not request.overwrite:
            self._refuse_existing(request.step, context)
        else:
            # Replacing renames the old directory away; let loads of it finish.
            _readers.wait_until_unread(path, context.async_options.timeout_secs)
        return path

    def _track(
        self,
        request: StepSave,
        path: epath.Path,
        metrics: dict[str, Any],
        inner: AsyncResponse[None],
        started: float,
        context: Context,
        reuse: reuse_lib.SaveReuse | None = None,
        staging: staging_lib.SaveStaging | None = None,
    ) -> AsyncResponse[bool]:
        """The response of the save, finished once the step is recorded (or the save failed).
        The step is read back under the save's ``context`` (its storage options)."""
        blocked = time.perf_counter() - started
        leaves = _save_stats.leaves(request.checkpointables)  # Counted in the background.
        step = request.step
        response = SaveResponse(f"save of step {step} to {path}", self._errors)
        with self._lock:
            self._in_flight = (step, response)

        def finish(done: AsyncResponse[None]) -> None:
            error = done.exception(0)
            if error is None:
                try:
                    with context:
                        self._record(step, path, metrics)
                    commit = time.perf_counter() - started
                    reused = reuse.bytes_reused if reuse is not None else 0
                    nbytes = _save_stats.array_bytes(leaves) - reused
                    self.last_stats = _save_stats.SaveStats(
                        step,
                        nbytes,
                        blocked,
                        commit,
                        bytes_reused=reused,
                        peak_staging_bytes=staging.peak_bytes if staging is not None else 0,
                    )
                    source = reuse.source if reuse is not None else None
                    _save_stats.log(self.last_stats, source.name if source else None)
                    if reuse is not None:  # What the next save takes from this step, read now.
                        reuse.committed(lambda: _identity_in(context, path))
                except BaseException as e:
                    error = e
            if error is not None:
                self._errors.record(error)
                response._finish(error=error)
                return
            # Queue the retention before the response is done, so that wait() and
            # close(), which wait for the response, then wait for it too.
            self._retention.schedule()
            response._finish(True)

        inner.add_done_callback(finish)
        return response

    def _record(self, step: int, path: epath.Path, metrics: dict[str, Any]) -> None:
        """Lists the step just committed, as its metadata says. The save is over once the
        commit is: a read-back that fails lists the step as the save knows it (so its
        retention runs), and is logged, never the save's error."""
        try:
            info = _listing.read_step(step, path)
        except (FileNotFoundError, errors.NotACheckpointError):
            # Not visible from here (process-local storage of another host).
            info = StepInfo(step=step, path=path, metrics=metrics)
        except (errors.CheckpointError, OSError) as e:
            logger.warning(
                "Step %d was committed at %s, but reading its metadata back failed: %s. It "
                "is listed as this save wrote it; if the read failed for damage, "
                "`checkpointables verify %s` says so.",
                step,
                path,
                e,
                path,
            )
            info = StepInfo(
                step=step, path=path, metrics=metrics, commit_timestamp_nsecs=time.time_ns()
            )
        self._steps.add(info)


@functools.cache
def _identity_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The thread reading a reusing save's source identity (one save at a time per
    Checkpointer; a few Checkpointers share it)."""
    return concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="checkpointables-reuse")


def _identity_in(context: Context, path: epath.Path) -> _commit.Identity:
    """``_commit.identity(path)`` under ``context`` (its storage options)."""
    with context:
        return _commit.identity(path)


def _occupant(known: bool, path: epath.Path, context: Context) -> str:
    """What the existing step directory ``path`` holds, for the error refusing the save: a
    step this Checkpointer did not list may be committed since (another Checkpointer or
    process saved it), which the disk tells (read-only)."""
    if known:
        return "a committed checkpoint"
    with context:
        committed = layout.is_checkpoint(path)
    if committed:
        return (
            "a committed checkpoint that another Checkpointer or process saved since this one "
            "listed the root (call reload() to list it)"
        )
    return "a directory that is not a committed checkpoint"


def _contained(step: int, path: epath.Path) -> bool:
    """Whether step ``path`` may be reused from: checked as a load checks a checkpoint (a
    symbolic link out of it, a pipe in it: said once in the log, as a WARNING)."""
    try:
        _confinement.check_contained(path)
    except FileNotFoundError:  # Deleted while being looked at.
        return False
    except (errors.OutsideCheckpointError, errors.IntegrityError, OSError) as e:
        # Refused, or unreadable (a directory it may not list): never a failed save.
        reuse_lib.log_once(
            f"uncontained:{path}",
            f"Step {step} is not reused from: {e} This save writes every array.",
            level=logging.WARNING,
        )
        return False
    return True
