"""Which steps a Checkpointer keeps, and the deletion of the others, in the background.

After each commit the preservation policy decides (the latest step is always
kept: a restarted run resumes from it), and the worker thread deletes the
other steps: each is first made invisible at once (renamed to a temporary
name, or its object-store marker deleted, so a half-deleted step is never
listed), then removed. A new Checkpointer decides too, on the steps it found
(a run killed between a commit and its retention left a step too many): it
makes the dropped steps invisible before it returns and removes them in the
background. A step being loaded by this process is deleted only after the
load finished (see ``_readers``). Every process decides, so that all list the
same steps; only the primary host touches the files. A save of a step that the
worker is to remove, or is removing, claims it first (``Removals``): on an object
store the save writes where the removal deletes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

from etils import epath

from checkpointables import _commit, _leftovers, storage
from checkpointables.context import Context
from checkpointables.training import _readers, _root_metadata
from checkpointables.training import preservation_policies as preservation_lib
from checkpointables.training._listing import StepIndex
from checkpointables.training._worker import Worker
from checkpointables.training.step_info import StepInfo

logger = logging.getLogger(__name__)


class Retention:
    """Keeps the steps the policy wants, deletes the others (see the module's docstring)."""

    def __init__(
        self,
        root: epath.Path,
        policy: preservation_lib.PreservationPolicy,
        steps: StepIndex,
        worker: Worker,
        *,
        context: Context,
        primary: bool,
    ) -> None:
        self._root = root
        self._policy = policy
        self._steps = steps
        self._worker = worker
        self._context = context
        self._primary = primary
        self._deferred = False  # A step was kept for a load: try again when loads end.
        self._removals = Removals()
        self._stopped = False
        # The steps of the last decision (at first, those found): a step the policy drops
        # that is not among them was committed since, below the latest, and is said so.
        self._known = {info.step for info in steps.sorted()}

    def apply_at_start(self) -> None:
        """Applies the policy to the steps the root held when the Checkpointer opened it.

        A run killed between a commit and the retention pass after it left a step
        more than its policy keeps (and a root may have been written under another
        policy). The dropped steps leave the listing now; their files are removed
        in the background. Steps being read stay, as after a commit.
        """
        if not isinstance(self._policy, preservation_lib.PreserveAll):
            self._collect(remove_in_background=True)

    def schedule(self) -> None:
        """Queues a decision (and deletions) on the worker, after a commit."""
        if not isinstance(self._policy, preservation_lib.PreserveAll):
            self._worker.submit(self._collect, key="gc")

    def after_read(self) -> None:
        """A load ended: deletions it deferred may run now."""
        if self._deferred and not self._stopped:
            self.schedule()

    def stop(self) -> None:
        """Schedules nothing more (the Checkpointer is closed)."""
        self._stopped = True

    def _collect(self, remove_in_background: bool = False) -> None:
        infos = self._steps.sorted()
        known, self._known = self._known, {info.step for info in infos}
        if len(infos) < 2:
            return
        keep = preservation_lib.checked_decision(
            self._policy, infos, preservation_lib.PreservationContext()
        )
        keep[-1] = True  # The latest step is what a restarted run resumes from.
        dropped = [info for info, kept in zip(infos, keep, strict=True) if not kept]
        if self._primary:  # Every process decides alike: one warning is enough.
            for info in dropped:
                if info.step not in known:
                    self._warn_dropped_at_once(info, infos[-1])
        done = [self._delete(info, remove_in_background) for info in dropped]
        self._deferred = not all(done)

    def _warn_dropped_at_once(self, info: StepInfo, latest: StepInfo) -> None:
        """A save committed ``info`` (its ``save*`` returned True) below the latest step,
        and the policy drops it at once: said, since the step seemed saved."""
        logger.warning(
            "Step %d of %s was saved below the latest step %d and is deleted at once: the "
            "preservation policy %r does not keep it. To keep it, save it under a step above "
            "%d, in another root directory, or with a preservation policy that keeps it.",
            info.step,
            self._root,
            latest.step,
            self._policy,
            latest.step,
        )

    def _delete(self, info: StepInfo, remove_in_background: bool) -> bool:
        """Deletes a step unless it is being read; returns False if deferred."""
        if not self._primary:
            self._steps.take(info, lambda: None)
            return True

        def retire() -> _commit.Retired | None:
            # From here on nobody sees the step (renamed away, or its marker deleted).
            return self._steps.take(info, lambda: _commit.retire(info.path))

        with self._context:
            ran, retired = _readers.run_if_unread(info.path, retire)
        if ran and retired is not None:
            self._removals.queue([retired.path])
            if remove_in_background:
                self._worker.submit(lambda: self._remove(retired))
            else:
                self._remove(retired)
        return ran

    def _remove(self, retired: _commit.Retired) -> None:
        if not self._removals.begin(retired.path):  # A save of the step took it over.
            return
        try:
            with self._context:
                retired.remove()
        finally:
            self._removals.end(retired.path)

    def claim(self, path: epath.Path, timeout: float) -> None:
        """Called by a save of the step at ``path`` before it looks there: a removal of
        ``path`` still queued is dropped (the save replaces what is there), one running is
        waited for (at most ``timeout`` seconds), so that no removal deletes what the save
        writes (see ``Removals``)."""
        self._removals.claim(path, timeout)

    def clean_leftovers(self, unfinished: Sequence[epath.Path]) -> None:
        """Removes, in the background, what dead saves and deletions left under the root.

        ``unfinished``: object-store step prefixes without a commit (each is
        removed if its record proves it abandoned when its turn comes, unless a save of
        the step claimed it first: ``Removals``).
        """
        timeout = self._context.async_options.timeout_secs
        directories = [self._root, self._root / _root_metadata.METADATA_DIR]
        entries = _leftovers.abandoned_entries(directories, timeout_secs=timeout)
        if not entries and not unfinished:
            return

        self._removals.queue(unfinished)

        def clean() -> None:
            with self._context:
                _leftovers.remove(entries)  # Temporary names: no save writes there again.
                removed = [p for p in unfinished if self._remove_if_abandoned(p, timeout)]
            if entries or removed:
                count = len(entries) + len(removed)
                logger.info("Removed %d abandoned leftovers under %s.", count, self._root)

        self._worker.submit(clean)

    def _remove_if_abandoned(self, prefix: epath.Path, timeout: float) -> bool:
        """Removes an unfinished object-store step whose record proves it abandoned, as it
        is when it is removed (not when the cleanup was queued); skipped once a save of
        the step claimed it."""
        if not self._removals.begin(prefix):
            return False
        try:
            return _leftovers.remove_unfinished(
                prefix, lambda r: _leftovers.record_is_abandoned(r, timeout_secs=timeout)
            )
        finally:
            self._removals.end(prefix)


class Removals:
    """The steps a Checkpointer's worker is to remove (queued) or is removing (running).

    On an object store a step is removed where its next save writes (the same prefix), so
    a save of the step that the worker is removing (an unfinished save's leftover, or a
    step the preservation policy dropped) would lose what it writes to the removal. A save
    claims its step first (``claim``): a queued removal is dropped, one running is waited
    for. On a local disk the worker removes temporary names no save writes again.
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._queued: set[str] = set()
        self._running: set[str] = set()

    def queue(self, paths: Iterable[epath.Path]) -> None:
        """Notes that ``paths`` are to be removed."""
        with self._condition:
            self._queued.update(storage.key(p) for p in paths)

    def begin(self, path: epath.Path) -> bool:
        """Whether the removal of ``path`` may start now (no save claimed it); if so, a
        save of it waits until ``end``."""
        key = storage.key(path)
        with self._condition:
            if key not in self._queued:
                return False
            self._queued.remove(key)
            self._running.add(key)
            return True

    def end(self, path: epath.Path) -> None:
        """The removal of ``path`` is over (done or failed)."""
        with self._condition:
            self._running.discard(storage.key(path))
            self._condition.notify_all()

    def claim(self, path: epath.Path, timeout: float) -> None:
        """Drops a queued removal of ``path``, waits for one running.

        Raises:
          TimeoutError: the removal is still running after ``timeout`` seconds.
        """
        key = storage.key(path)
        with self._condition:
            self._queued.discard(key)
            if not self._condition.wait_for(lambda: key not in self._running, timeout):
                raise TimeoutError(
                    f"The removal of what an unfinished save (or a deleted step) left at "
                    f"{path} is still running after {timeout} s, so a save there must wait. "
                    f"Save again later, or raise the timeout "
                    f"(cp.options.AsyncOptions(timeout_secs=...))."
                )
