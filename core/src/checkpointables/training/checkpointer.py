"""``Checkpointer``: a sequence of checkpoints of a training run under one root directory.

Every save goes through ``cp.save_checkpointables_async`` and every load
through the free loading functions, so each step directory is an ordinary
checkpoint: ``cp.load_pytree(root / "1000")`` works without a Checkpointer.

How it stays correct when things go wrong:

- Only committed steps are listed. The core writes each step under a
  temporary name and renames it into place once complete; the Checkpointer
  records a step only after that rename, from the save's background thread.
- At most one save is in flight. A new save first waits for the previous one
  (or, when the policy says so, e.g. ``ContinuousCheckpointingPolicy``, is
  skipped while one runs). A save that failed in the background raises from
  its response's ``result()`` or, if nobody asked, from the next ``save*``,
  ``wait()`` or ``close()``.
- Old steps are deleted by a background thread that never delays a save:
  first renamed to a temporary name (so a half-deleted step is never listed),
  then removed. A step being loaded by this process is deleted only after the
  load finished.
- A new Checkpointer deletes temporary directories whose owner is provably
  gone (see ``checkpointables._leftovers``), never another live process's save.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from etils import epath

from checkpointables import (
    _commit,
    _leftovers,
    _loading,
    _pytree_api,
    _saving,
    errors,
    layout,
    multihost,
    storage,
)
from checkpointables._asyncio import AsyncResponse, completed, start_background, waiting_caller
from checkpointables.checkpoint_metadata import CheckpointMetadata
from checkpointables.context import Context
from checkpointables.path._parse import as_path
from checkpointables.training import (
    _context,
    _listing,
    _metrics,
    _readers,
    _root_metadata,
    _save_stats,
    _worker,
)
from checkpointables.training import preservation_policies as preservation_lib
from checkpointables.training import save_decision_policies as decision_lib
from checkpointables.training.errors import StepAlreadyExistsError, StepNotFoundError
from checkpointables.training.step_info import RootMetadata, StepInfo
from checkpointables.training.step_name_formats import StepNameFormat, standard_name_format

__all__ = ["Checkpointer"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

StepLike = int | StepInfo | None


def as_step(step: Any) -> int:
    """``step`` as an int >= 0 (NumPy and JAX integer scalars are accepted)."""
    if isinstance(step, bool):
        raise errors.InvalidArgumentTypeError(f"Steps are integers >= 0, got the bool {step!r}.")
    try:
        value = operator.index(step)
    except TypeError:
        raise errors.InvalidArgumentTypeError(
            f"Steps are integers >= 0, got {type(step).__name__} {step!r}."
        ) from None
    if value < 0:
        raise errors.InvalidArgumentError(f"Steps are integers >= 0, got {value}.")
    return value


def _summary(steps: list[int]) -> str:
    if not steps:
        return "none"
    if len(steps) <= 8:
        return ", ".join(map(str, steps))
    return f"{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-3:]))}"


class _SaveResponse(AsyncResponse[bool]):
    """A save's response; an error seen through it is not raised again by the Checkpointer."""

    def __init__(self, description: str, on_reported: Callable[[BaseException], None]) -> None:
        super().__init__(description)
        self._on_reported = on_reported

    def result(self, timeout: float | None = None) -> bool:
        """Waits for the commit; True once committed. Re-raises a background failure."""
        error = self.exception(timeout)
        if error is not None:
            self._on_reported(error)
            raise error
        return bool(self._value)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Waits like ``result`` and returns the background error, or ``None``."""
        error = super().exception(timeout)
        if error is not None:
            self._on_reported(error)
        return error


def _policy(argument: str, value: Any, default: Callable[[], Any], method: str, module: str) -> Any:
    """``value`` (or ``default()`` when ``None``), checked to have ``method``."""
    chosen = default() if value is None else value
    if not callable(getattr(chosen, method.split("(")[0], None)):
        raise errors.InvalidArgumentTypeError(
            f"{argument} must have a {method} method (see cp.training.{module}), got {chosen!r}."
        )
    return chosen


class Checkpointer:
    """Saves and loads the checkpoints of a training run, one per step, under a root directory.

    Example::

        policy = cp.training.save_decision_policies.EveryNStepsPolicy(steps=1000)
        keep = cp.training.preservation_policies.LatestN(3)
        with cp.training.Checkpointer(root, save_decision_policy=policy,
                                      preservation_policy=keep) as ckptr:
            start = ckptr.latest_step()
            state = ckptr.load_pytree(start.step, abstract_state) if start else init_state
            for step in range(start.step + 1 if start else 0, num_steps):
                state, loss = train_step(state)
                ckptr.save_pytree_async(step, state, metrics={"loss": loss})

    Args:
      root_directory: where the steps live (created on the first save).
      save_decision_policy: decides which steps ``save*`` really saves (see
        ``save_decision_policies``). Default: the first step, then whenever no
        save is in flight (``InitialSavePolicy`` or ``ContinuousCheckpointingPolicy``).
      preservation_policy: decides which steps are kept (see
        ``preservation_policies``). Default: ``PreserveAll()``. The latest step
        is always kept.
      step_name_format: names step directories (see ``step_name_formats``).
        Default: the bare step number, as Orbax writes it.
      context: options for every save and load of this Checkpointer; a
        ``cp.Context`` entered around a call overrides it for that call.
      custom_metadata: JSON metadata for the whole run, written to
        ``<root>/metadata/_ROOT_METADATA`` if the root has none yet; read it
        back with ``metadata()``.

    Call every method from one thread (the training loop); background work
    is synchronized internally.
    """

    def __init__(
        self,
        root_directory: epath.PathLike,
        *,
        save_decision_policy: decision_lib.SaveDecisionPolicy | None = None,
        preservation_policy: preservation_lib.PreservationPolicy | None = None,
        step_name_format: StepNameFormat | None = None,
        context: Context | None = None,
        custom_metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self._root = as_path(root_directory)
        save_decision_policy = _policy(
            "save_decision_policy",
            save_decision_policy,
            decision_lib.default_policy,
            "should_save(step, previous_steps, *, context)",
            "save_decision_policies",
        )
        preservation_policy = _policy(
            "preservation_policy",
            preservation_policy,
            preservation_lib.PreserveAll,
            "should_preserve(steps, *, context)",
            "preservation_policies",
        )
        if step_name_format is None:
            step_name_format = standard_name_format()
        if not isinstance(step_name_format, StepNameFormat):
            raise errors.InvalidArgumentTypeError(
                f"step_name_format must have build_name(step) and parse_step(name) methods (see "
                f"cp.training.step_name_formats), got {step_name_format!r}."
            )
        if context is not None and not isinstance(context, Context):
            raise errors.InvalidArgumentTypeError(
                f"context must be a cp.Context, got {type(context).__name__}."
            )
        custom = (
            None
            if custom_metadata is None
            else _saving._json_or_raise(custom_metadata, "custom_metadata")
        )
        self._save_policy = save_decision_policy
        self._preservation_policy = preservation_policy
        self._name_format = step_name_format
        self._ambient = _context.active()
        self._context = _context.base_context(context)

        self._lock = threading.RLock()
        self._save: AsyncResponse[bool] | None = None
        self._save_step: int | None = None
        self._last_save_stats: _save_stats.SaveStats | None = None
        self._errors: list[BaseException] = []
        self._gc_deferred = False
        self._closed = False
        self._worker = _worker.Worker(f"checkpointables GC {self._root}", self._record_error)
        self._primary = multihost.is_primary_host(self._context)

        with self._context:  # An object store is reached as the context says.
            self._check_root()
            if custom is not None and self._primary:
                _root_metadata.write_if_absent(self._root, custom)
            listing = _listing.list_root(self._root, self._name_format)
        self._steps: dict[int, StepInfo] = listing.steps
        if self._primary:
            self._start_cleanup(listing.unfinished)

    def _check_root(self) -> None:
        if storage.is_file(self._root):
            raise NotADirectoryError(
                f"The root directory {self._root} is a file; a Checkpointer needs a directory "
                f"to hold one checkpoint per step."
            )
        if layout.is_checkpoint(self._root):
            raise errors.InvalidArgumentError(
                f"{self._root} is itself a checkpoint, not a root of step checkpoints. Pass the "
                f"directory that holds the steps (probably {self._root.parent}), or load this "
                f"checkpoint with the free functions (cp.load_pytree, cp.load_checkpointables)."
            )

    # Properties and listing.

    @property
    def directory(self) -> epath.Path:
        """The root directory."""
        return self._root

    def steps(self) -> list[StepInfo]:
        """The committed steps, sorted by step (as of creation, the last commit or ``reload()``)."""
        with self._lock:
            return [self._steps[s] for s in sorted(self._steps)]

    def latest_step(self) -> StepInfo | None:
        """The committed step with the highest number, or ``None`` for an empty root."""
        with self._lock:
            return self._steps[max(self._steps)] if self._steps else None

    @property
    def last_save_stats(self) -> _save_stats.SaveStats | None:
        """What the latest committed save cost (bytes, time blocked, time to commit), or None.

        Each committed save is also logged at INFO on ``checkpointables.training``.
        """
        with self._lock:
            return self._last_save_stats

    def is_saving_in_progress(self) -> bool:
        """Whether a save has started and not yet committed (or failed)."""
        with self._lock:
            return self._save is not None and not self._save.done()

    def should_save(self, step: int) -> bool:
        """Whether ``save*(step, ...)`` would save now (without ``force``)."""
        return self._decide(as_step(step))

    def reload(self) -> None:
        """Re-reads the root directory, e.g. to see steps another process wrote.

        Waits for this Checkpointer's save and deletions in flight first.
        """
        self._wait_for_save()
        self._worker.wait_idle()
        with self._call_context():
            steps = _listing.scan(self._root, self._name_format)
        with self._lock:
            self._steps = steps

    # Saving.

    def save_pytree(
        self,
        step: int,
        pytree: Any,
        *,
        checkpointable_name: str = _pytree_api.DEFAULT_NAME,
        force: bool = False,
        overwrite: bool = False,
        metrics: Mapping[str, Any] | None = None,
        custom_metadata: Mapping[str, Any] | None = None,
    ) -> bool:
        """Saves a pytree as ``step`` if the policy says so; waits for the commit.

        Returns:
          True if saved, False if the policy skipped the step.

        Raises:
          cp.training.errors.StepAlreadyExistsError: the step exists and
            ``overwrite`` is false.
        """
        with waiting_caller():
            response = self.save_pytree_async(
                step,
                pytree,
                checkpointable_name=checkpointable_name,
                force=force,
                overwrite=overwrite,
                metrics=metrics,
                custom_metadata=custom_metadata,
            )
        return response.result()

    def save_pytree_async(
        self,
        step: int,
        pytree: Any,
        *,
        checkpointable_name: str = _pytree_api.DEFAULT_NAME,
        force: bool = False,
        overwrite: bool = False,
        metrics: Mapping[str, Any] | None = None,
        custom_metadata: Mapping[str, Any] | None = None,
    ) -> AsyncResponse[bool]:
        """Starts saving a pytree as ``step`` if the policy says so.

        Returns once device data is copied to host (after waiting for the
        previous save, if one is in flight). ``result()`` of the response is
        True once the step is committed, False at once if the step was skipped.
        """
        return self._save_async(
            step,
            _pytree_api.pytree_item(checkpointable_name, pytree),
            force=force,
            overwrite=overwrite,
            metrics=metrics,
            custom_metadata=custom_metadata,
            pytree_name=checkpointable_name,
        )

    def save_checkpointables(
        self,
        step: int,
        checkpointables: Mapping[str, Any],
        *,
        force: bool = False,
        overwrite: bool = False,
        metrics: Mapping[str, Any] | None = None,
        custom_metadata: Mapping[str, Any] | None = None,
    ) -> bool:
        """Saves several checkpointables (e.g. ``{"pytree": state, "dataset": it}``) as ``step``.

        Like ``save_pytree``: returns True if saved, False if skipped.
        """
        with waiting_caller():
            response = self.save_checkpointables_async(
                step,
                checkpointables,
                force=force,
                overwrite=overwrite,
                metrics=metrics,
                custom_metadata=custom_metadata,
            )
        return response.result()

    def save_checkpointables_async(
        self,
        step: int,
        checkpointables: Mapping[str, Any],
        *,
        force: bool = False,
        overwrite: bool = False,
        metrics: Mapping[str, Any] | None = None,
        custom_metadata: Mapping[str, Any] | None = None,
    ) -> AsyncResponse[bool]:
        """Starts saving several checkpointables as ``step``; see ``save_pytree_async``."""
        return self._save_async(
            step,
            checkpointables,
            force=force,
            overwrite=overwrite,
            metrics=metrics,
            custom_metadata=custom_metadata,
            pytree_name=None,
        )

    def _save_async(
        self,
        step: int,
        checkpointables: Mapping[str, Any],
        *,
        force: bool,
        overwrite: bool,
        metrics: Mapping[str, Any] | None,
        custom_metadata: Mapping[str, Any] | None,
        pytree_name: str | None,
    ) -> AsyncResponse[bool]:
        if self._closed:
            raise RuntimeError(f"The Checkpointer of {self._root} is closed; create a new one.")
        started = time.perf_counter()
        step = as_step(step)
        self._raise_errors()
        if not force and not self._decide(step):
            return completed(False, f"skipped save of step {step}")
        # Check what can be checked before waiting for the previous save.
        layout.validate_checkpointables_dict(checkpointables)
        metric_values = _metrics.to_json(metrics)
        forced = (
            None
            if pytree_name is None
            else {pytree_name: _pytree_api.pytree_registration().handler_cls}
        )
        context = self._call_context()
        self._wait_for_save()
        self._raise_errors()
        path = self._step_path(step)
        with self._lock:
            known = step in self._steps
        with context:
            occupied = _commit.occupied(path)
        if not overwrite and (known or occupied):
            what = "a checkpoint" if known else "a directory that is not a committed checkpoint"
            raise StepAlreadyExistsError(
                f"Step {step} already exists: {path} holds {what}. Pass overwrite=True to "
                f"replace it (the old one stays until the new one commits), or save another step."
            )
        if overwrite:
            # Replacing renames the old directory away; let loads of it finish.
            _readers.wait_until_unread(path, context.async_options.timeout_secs)
        core = _saving.save_checkpointables_async(
            path,
            checkpointables,
            overwrite=overwrite,
            custom_metadata=custom_metadata,
            metrics=metric_values,
            forced_handlers=forced,
            context=context,
            # This root's only writer: an unfinished save at the step was interrupted.
            replace_unfinished=True,
        )
        blocked = time.perf_counter() - started
        nbytes = _save_stats.array_bytes(checkpointables)
        response = _SaveResponse(f"save of step {step} to {path}", self._mark_reported)
        with self._lock:
            self._save, self._save_step = response, step

        def finish(done: AsyncResponse[None]) -> None:
            error = done.exception(0)
            if error is None:
                try:
                    self._record_commit(step, path, metric_values)
                    self._record_stats(step, nbytes, blocked, time.perf_counter() - started)
                except BaseException as e:
                    error = e
            if error is not None:
                self._record_error(error)
                response._finish(error=error)
            else:
                # Queue the GC before the response is done, so that wait() and
                # close(), which wait for the response, then wait for it too.
                self._schedule_gc()
                response._finish(True)

        core.add_done_callback(finish)
        return response

    def _record_stats(self, step: int, nbytes: int, blocked: float, commit: float) -> None:
        stats = _save_stats.SaveStats(step, nbytes, blocked, commit)
        with self._lock:
            self._last_save_stats = stats
        _save_stats.log(stats)

    def _record_commit(self, step: int, path: epath.Path, metrics: dict[str, Any]) -> None:
        try:
            info = _listing.read_step(step, path)
        except (FileNotFoundError, errors.NotACheckpointError):
            # Not visible from here (process-local storage of another host).
            info = StepInfo(step=step, path=path, metrics=metrics)
        with self._lock:
            self._steps[step] = info

    def _decide(self, step: int) -> bool:
        with self._lock:
            previous = [self._steps[s] for s in sorted(self._steps)]
            in_progress = self._save is not None and not self._save.done()
        candidate = StepInfo(step=step, path=self._step_path(step))
        decision = bool(
            self._save_policy.should_save(
                candidate,
                previous,
                context=decision_lib.DecisionContext(is_saving_in_progress=in_progress),
            )
        )
        context = self._call_context()
        if multihost.is_coordinated(context):
            # Time- and progress-based policies can disagree between processes;
            # every process must make the same saves, so the primary decides.
            key = f"training/should_save/{multihost.next_operation_id()}"
            shared = multihost.broadcast_from_primary(key, str(int(decision)), context=context)
            decision = shared == "1"
        return decision

    def _step_path(self, step: int) -> epath.Path:
        return self._root / self._name_format.build_name(step)

    def _call_context(self) -> Context:
        return _context.for_call(self._context, self._ambient)

    def _wait_for_save(self) -> None:
        with self._lock:
            response = self._save
        if response is not None:
            # exception() waits without reporting: the error stays pending
            # (unless the caller saw it through the response).
            AsyncResponse.exception(response, self._context.async_options.timeout_secs)

    # Errors raised in the background.

    def _record_error(self, error: BaseException) -> None:
        with self._lock:
            self._errors.append(error)

    def _mark_reported(self, error: BaseException) -> None:
        with self._lock:
            self._errors = [e for e in self._errors if e is not error]

    def _raise_errors(self) -> None:
        with self._lock:
            pending, self._errors = self._errors, []
        if pending:
            first = pending[0]
            for other in pending[1:]:
                first.add_note(f"Another background failure: {type(other).__name__}: {other}")
            raise first

    # Garbage collection and cleanup.

    def _schedule_gc(self) -> None:
        # Every process decides (so that all list the same steps); only the
        # primary host touches the files.
        if isinstance(self._preservation_policy, preservation_lib.PreserveAll):
            return
        self._worker.submit(self._collect_garbage, key="gc")

    def _collect_garbage(self) -> None:
        with self._lock:
            infos = [self._steps[s] for s in sorted(self._steps)]
        if len(infos) < 2:
            return
        keep = preservation_lib.checked_decision(
            self._preservation_policy, infos, preservation_lib.PreservationContext()
        )
        keep[-1] = True  # The latest step is what a restarted run resumes from.
        deferred = False
        for info, kept in zip(infos, keep, strict=True):
            if not kept and not self._delete(info):
                deferred = True
        with self._lock:
            self._gc_deferred = deferred

    def _delete(self, info: StepInfo) -> bool:
        """Deletes a step unless it is being read; returns False if deferred."""
        if not self._primary:
            with self._lock:
                if self._steps.get(info.step) is info:
                    del self._steps[info.step]
            return True

        def retire() -> _commit.Retired | None:
            with self._lock:
                if self._steps.get(info.step) is not info:
                    return None  # Overwritten or already deleted since the decision.
                # From here on nobody sees the step (renamed away, or its marker deleted).
                retired = _commit.retire(info.path)
                del self._steps[info.step]
                return retired

        with self._context:
            ran, retired = _readers.run_if_unread(info.path, retire)
            if not ran:
                return False
            if retired is not None:
                retired.remove()
        return True

    def _after_read(self) -> None:
        with self._lock:
            retry = self._gc_deferred and not self._closed
        if retry:
            self._schedule_gc()

    def _start_cleanup(self, unfinished: Sequence[epath.Path]) -> None:
        """Removes what dead saves and deletions left under the root, in the background.

        ``unfinished``: object-store step prefixes without a commit (each is
        removed if its record proves it abandoned).
        """
        timeout = self._context.async_options.timeout_secs
        if not storage.is_local(self._root):
            if unfinished:
                self._worker.submit(
                    lambda: _commit.remove_abandoned(unfinished, timeout_secs=timeout)
                )
            return
        entries = _leftovers.abandoned_entries(
            [self._root, self._root / _root_metadata.METADATA_DIR], timeout_secs=timeout
        )
        if not entries:
            return
        logger.info("Removing %d abandoned temporary entries under %s.", len(entries), self._root)

        def remove_all() -> None:
            for entry in entries:
                _leftovers.remove(entry)

        self._worker.submit(remove_all)

    # Loading.

    def _resolve(self, step: StepLike) -> StepInfo:
        if step is None:
            latest = self.latest_step()
            if latest is None:
                raise StepNotFoundError(
                    f"{self._root} has no committed checkpoint yet, so there is no latest step to "
                    f"load. Check the path, or call reload() if another process is writing it."
                )
            return latest
        number = as_step(step.step if isinstance(step, StepInfo) else step)
        with self._lock:
            info = self._steps.get(number)
            in_flight = self._save if self._save_step == number else None
        if info is None and in_flight is not None:
            AsyncResponse.exception(in_flight, self._context.async_options.timeout_secs)
            with self._lock:
                info = self._steps.get(number)
        if info is not None:
            return info
        path = self._step_path(number)
        with self._call_context():
            if layout.is_checkpoint(path):  # Committed by another process since we listed.
                return _listing.read_step(number, path)
        with self._lock:
            known = sorted(self._steps)
        raise StepNotFoundError(
            f"No committed checkpoint for step {number} in {self._root} (looked for {path}). "
            f"Committed steps: {_summary(known)}."
        )

    def _acquire(self, step: StepLike) -> tuple[StepInfo, str]:
        """Registers ``step`` as being read (GC then leaves it alone) until ``_release``."""
        info = self._resolve(step)
        key = _readers.acquire(info.path)
        with self._call_context():
            gone = not storage.exists(info.path)
        if gone:
            self._release(key)
            raise StepNotFoundError(
                f"Step {info.step} was deleted from {self._root} (by this run's preservation "
                f"policy or another process). Call steps() for what remains."
            )
        return info, key

    def _release(self, key: str) -> None:
        _readers.release(key)
        self._after_read()

    @contextlib.contextmanager
    def _reading(self, step: StepLike) -> Iterator[StepInfo]:
        """``step``, registered as being read during the block, under the call's context."""
        info, key = self._acquire(step)
        try:
            with self._call_context():
                yield info
        finally:
            self._release(key)

    def _load_async(
        self, step: StepLike, start: Callable[[epath.Path], AsyncResponse[T]]
    ) -> AsyncResponse[T]:
        """``start(path)`` for ``step``; the step counts as read until the load finishes."""
        info, key = self._acquire(step)
        try:
            with self._call_context():
                inner = start(info.path)
        except BaseException:
            self._release(key)
            raise

        def finish() -> T:
            try:
                return inner.result()
            finally:
                self._release(key)

        return start_background(finish, f"load of step {info.step} from {self._root}", daemon=True)

    def load_pytree_async(
        self,
        step: StepLike = None,
        abstract_pytree: Any = None,
        *,
        checkpointable_name: str | None = None,
        partial_load: bool = False,
    ) -> AsyncResponse[Any]:
        """Starts loading the pytree of ``step`` (default: the latest step).

        Takes the arguments of ``cp.load_pytree`` (see there).

        Raises:
          cp.training.errors.StepNotFoundError: no committed checkpoint for the step.
        """
        return self._load_async(
            step,
            lambda path: _pytree_api.load_pytree_async(
                path,
                abstract_pytree,
                checkpointable_name=checkpointable_name,
                partial_load=partial_load,
            ),
        )

    def load_pytree(
        self,
        step: StepLike = None,
        abstract_pytree: Any = None,
        *,
        checkpointable_name: str | None = None,
        partial_load: bool = False,
    ) -> Any:
        """Loads the pytree of ``step`` (default: the latest step).

        Example::

            state = ckptr.load_pytree(ckptr.latest_step(), abstract_state)
        """
        return self.load_pytree_async(
            step,
            abstract_pytree,
            checkpointable_name=checkpointable_name,
            partial_load=partial_load,
        ).result()

    def load_checkpointables_async(
        self, step: StepLike = None, abstract_checkpointables: Mapping[str, Any] | None = None
    ) -> AsyncResponse[dict[str, Any]]:
        """Starts loading checkpointables of ``step`` (default: the latest step)."""
        return self._load_async(
            step, lambda path: _loading.load_checkpointables_async(path, abstract_checkpointables)
        )

    def load_checkpointables(
        self, step: StepLike = None, abstract_checkpointables: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Loads checkpointables of ``step`` (default: the latest step).

        Example::

            restored = ckptr.load_checkpointables(None, {"pytree": abstract, "dataset": iterator})
        """
        return self.load_checkpointables_async(step, abstract_checkpointables).result()

    # Metadata.

    def root_metadata(self) -> RootMetadata:
        """The run's metadata: ``.custom_metadata`` as given when the root was first written."""
        return RootMetadata(directory=self._root, custom_metadata=_root_metadata.read(self._root))

    def metadata(self, step: StepLike = None) -> Any:
        """``metadata()``: the root's ``RootMetadata``; ``metadata(step)``: pytree metadata.

        ``metadata(step)`` is ``cp.pytree_metadata`` of the step: its
        ``.metadata`` is the abstract tree (usable as ``abstract_pytree``) and
        it also has ``.metrics`` and ``.custom_metadata``.
        """
        if step is None:
            return self.root_metadata()
        return self.pytree_metadata(step)

    def pytree_metadata(
        self, step: StepLike = None, *, checkpointable_name: str | None = None
    ) -> CheckpointMetadata[Any]:
        """``cp.pytree_metadata`` of ``step`` (default: the latest step)."""
        with self._reading(step) as info:
            return _pytree_api.pytree_metadata(info.path, checkpointable_name=checkpointable_name)

    def checkpointables_metadata(self, step: StepLike = None) -> CheckpointMetadata[dict[str, Any]]:
        """``cp.checkpointables_metadata`` of ``step`` (default: the latest step)."""
        with self._reading(step) as info:
            return _loading.checkpointables_metadata(info.path)

    # Waiting and closing.

    def wait(self) -> None:
        """Waits for the save and deletions in flight; raises a background failure not yet seen."""
        self._wait_for_save()
        self._worker.wait_idle()
        self._raise_errors()

    def close(self) -> None:
        """Waits like ``wait()``, then stops background work. Later saves raise."""
        try:
            self.wait()
        finally:
            with self._lock:
                self._closed = True
            self._worker.stop()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as close_error:
            # Don't hide the error that ended the block; attach the other one.
            exc.add_note(f"Also, while closing the Checkpointer: {close_error!r}")

    def __repr__(self) -> str:
        latest = self.latest_step()
        return (
            f"Checkpointer({os.fspath(self._root)!r}, steps={len(self._steps)}, "
            f"latest={latest.step if latest else None})"
        )

    # Short names, as for the free functions.
    save = save_pytree
    save_async = save_pytree_async
    load = load_pytree
    load_async = load_pytree_async
