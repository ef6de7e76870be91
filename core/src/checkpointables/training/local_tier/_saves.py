"""The local tier's saves: decided by its own policy, written, committed, replicated, retained.

A local save of step ``s`` by process ``i`` of ``n``:

1. **decide**: the tier's policy, on the steps this host holds (in a
   multi-process job the primary decides for all, as for persistent saves);
2. **write**: an ordinary checkpoint of this process's shards (process-local
   storage: ``primary_host=None``) at ``<dir>/<s>/p<i>-of-<n>``, through the
   core's save (temporary name, rename on commit);
3. **commit**: the manifest (file checksums, shards held, and the copies of
   step ``s`` and later steps this host held as the save started: the
   trajectory it leaves, ``left``) is written next to it; the save's response
   finishes here;
4. **replicate** (background, in order): the manifest and this process's
   address are published; the copies of the ``replicas`` processes before
   this one (``i-1, i-2, ...`` mod ``n``) are fetched from them, and from
   every other process the small part of its copy (its checkpointables
   without arrays: JSON, iterators, custom items; ``Manifest.small_part``),
   all within one bound; a failure is logged with the host it names (fewer
   copies, never a wrong step: restores decide from what hosts really hold);
5. **retain**: all but the newest ``keep`` steps are removed from this host
   (at the commit, before the response finishes, and after replication); at
   the commit, so are the steps after ``s``: the run went on from an older
   step, and they belong to the trajectory it left.

One local save is in flight at a time: the next one waits for the previous
one's commit and replication (each replication wait is bounded).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from checkpointables import _pytree_api, _saving, multihost
from checkpointables import options as options_lib
from checkpointables._asyncio import AsyncResponse
from checkpointables.context import Context
from checkpointables.training import _metrics
from checkpointables.training import save_decision_policies as decision_lib
from checkpointables.training._saves import StepSave
from checkpointables.training._worker import Worker
from checkpointables.training.local_tier import _manifest, _transport
from checkpointables.training.local_tier._config import LocalTier
from checkpointables.training.local_tier._exchange import Exchange
from checkpointables.training.local_tier._manifest import Manifest
from checkpointables.training.local_tier._store import Store, writer_name
from checkpointables.training.step_info import StepInfo

logger = logging.getLogger("checkpointables.training")

__all__ = ["LocalSaves", "local_context"]

# What a wait gets when the shared bound has passed: a peer that published long ago
# still answers.
_MIN_WAIT_SECS = 0.5


def local_context(context: Context) -> Context:
    """``context`` for process-local storage: every process writes and reads on its own."""
    return Context(
        context, multiprocessing_options=options_lib.MultiprocessingOptions(primary_host=None)
    )


class LocalSaves:
    """The saves of one Checkpointer's local tier (see the module's docstring)."""

    def __init__(
        self,
        config: LocalTier,
        store: Store,
        exchange: Exchange,
        address: Callable[[], str],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self._config = config
        self._store = store
        self._exchange = exchange
        self._address = address
        self._writer = writer_name(exchange.me, exchange.count)
        self._lock = threading.Lock()
        self._in_flight: AsyncResponse[bool] | None = None
        self._count = 0  # The n-th local save: the same on every process.
        self._worker = Worker(f"checkpointables local tier {store.directory}", on_error)

    def steps(self) -> list[StepInfo]:
        """The steps with a finished copy on this host, sorted; each one's path is that
        copy's, an ordinary checkpoint (of this host's shards, when several saved it):
        this process's own copy if there is one, else a whole copy if there is one."""
        infos = [self._copy(step, whole=False) for step in self._store.steps()]
        return [info for info in infos if info is not None]

    def whole_copy(self, step: int) -> StepInfo | None:
        """A finished copy of ``step`` on this host that holds every checkpointable (not a
        *partial* copy, of a peer's small items only), this process's own first; or None."""
        return self._copy(step, whole=True)

    def _copy(self, step: int, *, whole: bool) -> StepInfo | None:
        copies = self._store.copies(step)
        # This process's own copy first, then whole ones (sorted: stable across calls).
        order = sorted(copies, key=lambda w: (w != self._writer, copies[w].partial, w))
        if whole:
            order = [w for w in order if not copies[w].partial]
        if not order:
            return None
        chosen = copies[order[0]]
        return StepInfo(
            step=step,
            path=self._store.copy_dir(step, order[0]),
            metrics=chosen.metrics,
            commit_timestamp_nsecs=chosen.commit_timestamp_nsecs,
        )

    def in_progress(self) -> bool:
        """Whether a local save has started and not committed."""
        with self._lock:
            return self._in_flight is not None and not self._in_flight.done()

    def decide(self, step: int, context: Context) -> bool:
        """Whether the tier's policy saves ``step`` now (the primary's answer on every process)."""
        policy = self._config.save_decision_policy
        assert policy is not None  # The converter supplies the default.
        candidate = StepInfo(step=step, path=self._store.step_dir(step))
        in_progress = decision_lib.DecisionContext(is_saving_in_progress=self.in_progress())
        decision = bool(policy.should_save(candidate, self.steps(), context=in_progress))
        if multihost.is_coordinated(context):
            key = f"training/local_tier/should_save/{multihost.next_operation_id()}"
            shared = multihost.broadcast_from_primary(key, str(int(decision)), context=context)
            return shared == "1"
        return decision

    def wait(self, timeout: float | None = None) -> None:
        """Waits for the local save in flight to commit (its error is the caller's to see)."""
        with self._lock:
            in_flight = self._in_flight
        if in_flight is not None:
            AsyncResponse.exception(in_flight, timeout)

    def wait_idle(self) -> None:
        """Waits for the save in flight, then for replication and retention."""
        self.wait(self._config.timeout_secs)
        self._worker.wait_idle()

    def close(self) -> None:
        """Waits for everything, then stops the background thread."""
        self.wait()
        self._worker.stop()

    def start(self, request: StepSave, context: Context) -> AsyncResponse[bool]:
        """Starts the local save of ``request`` (phases 2-5); returns after the blocking phase."""
        # The previous save's replication first: a peer still fetching a step must not see
        # it retired by newer ones, and copies never pile up faster than they move.
        self.wait_idle()
        # Something the tier did not write under this step's number: refused, not replaced.
        self._store.check_own(request.step)
        number, self._count = self._count, self._count + 1
        held, every = _manifest.describe_shards(request.checkpointables)
        # Read before the removals: they are what this save's manifest says it left.
        left = self._store.left_behind(request.step)
        # A step directory already here was written by an earlier incarnation of the run
        # (it resumed from an older step): its copies are of other data.
        self._store.remove_step(request.step)
        path = self._store.copy_dir(request.step, self._writer)
        forced = None
        if request.pytree_name is not None:
            forced = {request.pytree_name: _pytree_api.pytree_registration().handler_cls}
        metrics = _metrics.to_json(request.metrics)
        inner = _saving.start(
            _saving.SaveRequest(
                path,
                request.checkpointables,
                request.custom_metadata,
                False,
                metrics,
                forced,
                local_context(context),
                replace_unfinished=True,
            )
        )
        fields = {
            "process_index": self._exchange.me,
            "process_count": self._exchange.count,
            "held": held,
            "shards": every,
            "small": _manifest.small_items(request.checkpointables),
            "metrics": metrics,
            "run": self._store.run,
            "left": left,
        }
        response: AsyncResponse[bool] = AsyncResponse(f"local save of step {request.step}")
        with self._lock:
            self._in_flight = response
        inner.add_done_callback(
            lambda done: self._commit(done, number, request.step, fields, response)
        )
        return response

    def _commit(
        self,
        done: AsyncResponse[None],
        number: int,
        step: int,
        fields: dict[str, Any],
        response: AsyncResponse[bool],
    ) -> None:
        error = done.exception(0)
        manifest = None
        if error is None:
            try:
                manifest = _manifest.build(
                    self._store.copy_dir(step, self._writer), step, self._writer, **fields
                )
                self._store.commit_copy(manifest)
                # Listed steps obey keep once committed; newer ones are another trajectory's.
                self._store.retain(self._config.keep, newest=step)
            except Exception as e:
                error = e
        if error is not None or manifest is None:
            response._finish(error=error)
            return
        # Queued before the response finishes, so that wait_idle() after it covers it.
        self._worker.submit(lambda: self._replicate(number, manifest))
        response._finish(True)

    def _sources(self) -> list[int]:
        """The processes whose copies this one keeps."""
        n, me = self._exchange.count, self._exchange.me
        return [(me - k) % n for k in range(1, min(self._config.replicas, n - 1) + 1)]

    def _replicate(self, number: int, manifest: Manifest) -> None:
        if self._exchange.count > 1:
            name = f"save/{number}"
            self._exchange.publish(
                name, json.dumps({"address": self._address(), "manifest": manifest.to_json()})
            )
            sources = self._sources()
            others = [
                p for p in range(self._exchange.count) if p not in (self._exchange.me, *sources)
            ]
            # One bound for all: a dead peer costs one timeout, not one per peer.
            deadline = time.monotonic() + self._config.timeout_secs
            for source in sources + others:
                try:
                    remaining = max(deadline - time.monotonic(), _MIN_WAIT_SECS)
                    offer = json.loads(self._exchange.get(name, source, remaining))
                    theirs = Manifest.from_json(offer["manifest"])  # ValueError: malformed.
                    if source not in sources:
                        theirs = theirs.small_part()  # Small items: on every host.
                    _transport.fetch_copy(offer["address"], theirs, self._store, remaining)
                except (OSError, ValueError, multihost.BarrierTimeoutError) as e:
                    logger.warning(
                        "Local tier: no copy of process %d's step %d on this host: %s",
                        source,
                        manifest.step,
                        e,
                    )
        self._store.retain(self._config.keep)
