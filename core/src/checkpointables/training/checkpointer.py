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
  gone (see ``checkpointables._leftovers``), never another live process's save,
  and applies its preservation policy at once (a kill between a commit and
  the retention after it leaves a step too many).

The concerns live in their own modules: saving (``_saves``), retention and
deletion (``_retention``), finding the step a load means and leasing it
(``_readers``), the root and its committed steps (``_listing``), background
work and its errors (``_worker``), checks of arguments (``_arguments``). This
class holds the front doors; every synchronous form waits for its async form.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from etils import epath

from checkpointables import _loading, _pytree_api, errors, multihost, options, storage
from checkpointables import reuse as reuse_lib
from checkpointables._asyncio import AsyncResponse, synchronous
from checkpointables.checkpoint_metadata import CheckpointMetadata
from checkpointables.context import Context
from checkpointables.path._parse import as_path
from checkpointables.training import _context, _listing, _readers, _root_metadata, _save_stats
from checkpointables.training import preservation_policies as preservation_lib
from checkpointables.training import save_decision_policies as decision_lib
from checkpointables.training._arguments import as_step, checked
from checkpointables.training._readers import StepLike
from checkpointables.training._retention import Retention
from checkpointables.training._saves import Saves, StepSave
from checkpointables.training._worker import BackgroundErrors, Worker
from checkpointables.training.errors import CheckpointerClosedError, StepNotFoundError
from checkpointables.training.local_tier import LocalTier, RestoreStats, _tiered
from checkpointables.training.step_info import RootMetadata, StepInfo
from checkpointables.training.step_name_formats import StepNameFormat, standard_name_format

__all__ = ["Checkpointer", "STATE_NAME"]

T = TypeVar("T")


def _reuse_setting(
    reuse_unchanged: bool | Callable[[str], bool] | None, root: epath.Path
) -> tuple[bool, Callable[[str], bool] | None]:
    """``(on, frozen)`` for the ``reuse_unchanged`` argument (see ``Checkpointer``)."""
    if reuse_unchanged is None:
        # Safe: local storage links files, S3 copies objects on the server (GCS would
        # rewrite them anyway). Cheap: on an accelerator a fingerprint reads device memory
        # (TB/s); host data is hashed by XXH3 at memory speed (about 10 GB/s per core), a
        # fraction of the write it saves.
        return storage.scheme_of(root) in (None, "s3"), None
    if callable(reuse_unchanged):
        return True, reuse_lib.checked_frozen(reuse_unchanged)
    on = options.python_scalar(reuse_unchanged)  # np.True_ is True.
    if type(on) is not bool:
        raise errors.InvalidArgumentTypeError(
            f"reuse_unchanged must be True, False, None or a predicate on leaf names, got "
            f"{type(reuse_unchanged).__name__}: for the leaves under a prefix, pass "
            f"lambda name: name.startswith('base.') (docs/incremental.md)."
        )
    return on, None


# The pytree's checkpointable name in a step: Orbax's training Checkpointer's, so that its
# load(step) reads our steps. Loads without a name also find "pytree", the name before.
STATE_NAME = "state"


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
      reuse_unchanged: each save links the arrays that did not change since the newest
        committed step from it instead of writing them (``docs/incremental.md``); the
        step is still complete on its own. ``None`` (default): on for a local or ``s3://``
        root (hard links; server-side copies), off on ``gs://`` (no server-side copy
        here). A callable is a
        predicate on a leaf's storage name (``"params.encoder.w"``) declaring the
        leaves it accepts frozen: those skip the fingerprint.
      local_tier: a ``cp.training.LocalTier``: also save, at its own cadence, to
        each host's own disk (replicated to peers); loads then restore the
        newest complete step on either tier (see ``docs/local-tier.md``).

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
        reuse_unchanged: bool | Callable[[str], bool] | None = None,
        local_tier: LocalTier | None = None,
    ) -> None:
        self._root = as_path(root_directory)
        self._name_format = checked(
            "step_name_format", step_name_format, standard_name_format, StepNameFormat
        )
        keep, decide = _checked_policies(preservation_policy, save_decision_policy)
        if context is not None:
            checked("context", context, Context, Context)
        self._ambient = _context.active()
        self._context = _context.base_context(context)
        self._primary = multihost.is_primary_host(self._context)
        self._closed = False
        self._errors = BackgroundErrors()
        self._worker = Worker(f"checkpointables GC {self._root}", self._errors.record)
        listing = _listing.open_root(
            self._root,
            self._name_format,
            custom_metadata,
            context=self._context,
            primary=self._primary,
        )
        self._steps = _listing.StepIndex(listing.steps)
        self._retention = Retention(
            self._root,
            keep,
            self._steps,
            self._worker,
            context=self._context,
            primary=self._primary,
        )
        self._saves = Saves(self._step_path, decide, self._steps, self._retention, self._errors)
        self._saves.reuse = _reuse_setting(reuse_unchanged, self._root)
        after_read = self._retention.after_read
        self._leases = _readers.Leases(
            self._root, self._steps, self._step_path, self._wait_for_save, after_read
        )
        self._tidy_root(listing)
        self._persistent_stats: RestoreStats | None = None
        self._local = _tiered.open_tier(local_tier, self._root, self._errors.record)

    def _tidy_root(self, listing: _listing.Listing) -> None:
        """Applies the preservation policy to the steps found, removes what dead saves left."""
        try:
            self._retention.apply_at_start()
        except Exception as e:  # As after a commit: raised by the next save, wait() or close().
            self._errors.record(e)
        if self._primary:
            self._retention.clean_leftovers(listing.unfinished)

    # Properties and listing.

    @property
    def directory(self) -> epath.Path:
        """The root directory."""
        return self._root

    def steps(self, tier: str | None = None) -> list[StepInfo]:
        """The committed steps, sorted by step (as of creation, the last commit or ``reload()``).

        With a local tier, ``tier`` picks which: ``"persistent"`` (the root),
        ``"local"`` (the steps with a copy on this host's local directory), or
        ``None``: both (a step on both is listed once, as the persistent one).
        """
        return _tiered.steps(self._steps.sorted(), self._local, tier)

    def latest_step(self) -> StepInfo | None:
        """The committed step with the highest number on any tier, or ``None`` if none.

        With a local tier: the newest step a restore could read, the same on every
        process (call it on all of them): a local step counts once it is complete over
        the hosts, not while only some hold their copies. Checksums are checked by the
        load itself; ``load_*()`` without a step moves past a damaged copy.
        """
        return _tiered.latest(self._steps.sorted(), self._local)

    @property
    def last_restore_stats(self) -> RestoreStats | None:
        """Where the latest load of a step read its bytes (own disk, peers, persistent
        storage) and how long it took; ``None`` before the first load."""
        return self._last_restore_stats()

    @property
    def last_save_stats(self) -> _save_stats.SaveStats | None:
        """What the latest committed save cost (bytes, time blocked, time to commit), or None.

        Each committed save is also logged at INFO on ``checkpointables.training``.
        """
        return self._saves.last_stats

    def is_saving_in_progress(self) -> bool:
        """Whether a save has started and not yet committed (or failed)."""
        return self._saves.in_progress()

    def should_save(self, step: int) -> bool:
        """Whether ``save*(step, ...)`` would save now (without ``force``)."""
        return self._saves.decide(as_step(step), self._call_context())

    def reload(self) -> None:
        """Re-reads the root directory, e.g. to see steps another process wrote.

        Waits for this Checkpointer's save and deletions in flight first.
        """
        self._saves.wait(self._context.async_options.timeout_secs)
        self._worker.wait_idle()
        with self._call_context():
            self._steps.replace_all(_listing.list_root(self._root, self._name_format).steps)

    # Saving.

    def _save_async(self, request: StepSave) -> AsyncResponse[bool]:
        if self._closed:
            raise CheckpointerClosedError(
                f"The Checkpointer of {self._root} is closed; create a new one to save there."
            )
        return _tiered.save(request, self._call_context(), self._saves, self._local)

    def save_pytree_async(
        self,
        step: int,
        pytree: Any,
        *,
        checkpointable_name: str = STATE_NAME,
        force: bool = False,
        overwrite: bool = False,
        metrics: Mapping[str, Any] | None = None,
        custom_metadata: Mapping[str, Any] | None = None,
    ) -> AsyncResponse[bool]:
        """Starts saving a pytree as ``step`` if the policy says so.

        Returns once device data is copied to host (after waiting for the
        previous save, if one is in flight). ``result()`` of the response is
        True once the step is committed, False at once if the step was skipped.
        The pytree is the checkpointable ``state`` (Orbax's training Checkpointer's
        name) unless ``checkpointable_name`` says otherwise; ``metrics`` are also
        written where Orbax reads them (``metrics/metrics``).
        """
        item = _pytree_api.pytree_item(checkpointable_name, pytree)
        return self._save_async(
            StepSave(
                as_step(step), item, force, overwrite, metrics, custom_metadata, checkpointable_name
            )
        )

    @synchronous(save_pytree_async)
    def save_pytree(
        self,
        step: int,
        pytree: Any,
        *,
        checkpointable_name: str = STATE_NAME,
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
            StepSave(as_step(step), checkpointables, force, overwrite, metrics, custom_metadata)
        )

    @synchronous(save_checkpointables_async)
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
        """Saves several checkpointables (e.g. ``{"state": state, "dataset": it}``) as ``step``.

        Like ``save_pytree``: returns True if saved, False if skipped.
        """

    # Loading.

    def _step_path(self, step: int) -> epath.Path:
        return self._root / self._name_format.build_name(step)

    def _call_context(self) -> Context:
        return _context.for_call(self._context, self._ambient)

    def _wait_for_save(self, step: int) -> None:
        self._saves.wait(self._context.async_options.timeout_secs, step=step)

    def _load_async(
        self,
        step: StepLike,
        start: Callable[[epath.Path], AsyncResponse[T]],
        abstract: Mapping[str, Any] | None = None,
    ) -> AsyncResponse[T]:
        context = self._call_context()
        if self._local is None:

            def load() -> AsyncResponse[T]:
                info = self._leases.resolve(step, context)
                response = self._leases.load_async(info, context, start)
                return _tiered.timed(response, info, self._set_persistent_stats)

            return self._latest_again(step, load)
        number = (
            None if step is None else as_step(step.step if isinstance(step, StepInfo) else step)
        )
        return self._local.load_async(
            number,
            context,
            start,
            abstract,
            self._steps.sorted(),
            lambda info, go: self._leases.load_async(info, context, go),
        )

    def _latest_again(self, step: StepLike, attempt: Callable[[], T]) -> T:
        """``attempt()``; if it was for the latest step (``step`` is ``None``) and failed
        after a load found a listed step deleted (by another process's preservation policy:
        an evaluator watching a trainer's root), once more after ``reload()``: the list is
        stale, and the latest step is a newer one."""
        try:
            return attempt()
        except StepNotFoundError:
            if step is not None or not self._steps.forgotten:
                raise
        self.reload()
        return attempt()

    def _last_restore_stats(self) -> RestoreStats | None:
        if self._local is not None:
            return self._local.last_restore_stats
        return self._persistent_stats

    def _set_persistent_stats(self, stats: RestoreStats) -> None:
        self._persistent_stats = stats

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
        # Checked before the step is looked for: its load may start later, or never.
        partial_load = options.checked_bool(partial_load, "partial_load")
        return self._load_async(
            step,
            lambda path: _pytree_api.load_pytree_async(
                path,
                abstract_pytree,
                checkpointable_name=checkpointable_name,
                partial_load=partial_load,
            ),
            None
            if abstract_pytree is None
            else {checkpointable_name or STATE_NAME: abstract_pytree},
        )

    @synchronous(load_pytree_async)
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

    def load_checkpointables_async(
        self, step: StepLike = None, abstract_checkpointables: Mapping[str, Any] | None = None
    ) -> AsyncResponse[dict[str, Any]]:
        """Starts loading checkpointables of ``step`` (default: the latest step)."""
        return self._load_async(
            step,
            lambda path: _loading.load_checkpointables_async(path, abstract_checkpointables),
            abstract_checkpointables,
        )

    @synchronous(load_checkpointables_async)
    def load_checkpointables(
        self, step: StepLike = None, abstract_checkpointables: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Loads checkpointables of ``step`` (default: the latest step).

        Example::

            restored = ckptr.load_checkpointables(None, {"state": abstract, "dataset": iterator})
        """

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
        """``cp.pytree_metadata`` of ``step`` (default: the latest persistent step).

        With a local tier, a step only the local tier holds is read from this
        host's copy of it.
        """
        return self._read_metadata(
            step,
            lambda path: _pytree_api.pytree_metadata(path, checkpointable_name=checkpointable_name),
        )

    def checkpointables_metadata(self, step: StepLike = None) -> CheckpointMetadata[dict[str, Any]]:
        """``cp.checkpointables_metadata`` of ``step`` (default: the latest persistent step;
        a step only the local tier holds: this host's copy of it)."""
        return self._read_metadata(step, _loading.checkpointables_metadata)

    def _read_metadata(self, step: StepLike, read: Callable[[epath.Path], T]) -> T:
        context = self._call_context()
        try:
            info = self._leases.resolve(step, context)
        except StepNotFoundError as missing:
            if self._local is None or step is None:
                raise
            number = as_step(step.step if isinstance(step, StepInfo) else step)
            return _tiered.local_metadata(self._local, number, context, read, missing)

        def attempt() -> T:
            with self._leases.holding(step if step is None else info, context) as held:
                return read(held.path)

        return self._latest_again(step, attempt)

    # Waiting and closing.

    def wait(self) -> None:
        """Waits for the save and deletions in flight (and the local tier's saves and
        replication); raises a background failure not yet seen."""
        self._saves.wait(self._context.async_options.timeout_secs)
        self._worker.wait_idle()
        if self._local is not None:
            self._local.saves.wait_idle()
        self._errors.raise_pending()

    def close(self) -> None:
        """Waits like ``wait()``, then stops background work. Later saves raise
        ``cp.training.errors.CheckpointerClosedError`` (loads still work)."""
        try:
            self.wait()
        finally:
            self._closed = True
            self._retention.stop()
            self._worker.stop()
            if self._local is not None:
                self._local.close()

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
            f"Checkpointer({os.fspath(self._root)!r}, steps={len(self.steps())}, "
            f"latest={latest.step if latest else None})"
        )

    # Short names, as for the free functions.
    save = save_pytree
    save_async = save_pytree_async
    load = load_pytree
    load_async = load_pytree_async


def _checked_policies(
    preservation_policy: preservation_lib.PreservationPolicy | None,
    save_decision_policy: decision_lib.SaveDecisionPolicy | None,
) -> tuple[preservation_lib.PreservationPolicy, decision_lib.SaveDecisionPolicy]:
    """The Checkpointer's two policies, defaults filled in, each of the right kind."""
    keep = checked(
        "preservation_policy",
        preservation_policy,
        preservation_lib.PreserveAll,
        preservation_lib.PreservationPolicy,
    )
    decide = checked(
        "save_decision_policy",
        save_decision_policy,
        decision_lib.default_policy,
        decision_lib.SaveDecisionPolicy,
    )
    return keep, decide
