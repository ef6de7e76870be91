"""A Checkpointer's local tier at run time: its store, file service, saves and restores.

The Checkpointer hands it the requests its front doors receive; it saves
those its policy chooses (``_saves``) and decides every restore over both
tiers (``_restore``), loading a persistent step through the Checkpointer's
own path (with its read leases) when that step wins.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
from etils import epath

from checkpointables import errors, multihost, storage
from checkpointables._asyncio import AsyncResponse, start_background
from checkpointables.context import Context
from checkpointables.training.errors import StepNotFoundError
from checkpointables.training.local_tier import _manifest, _owner, _restore, _transport
from checkpointables.training.local_tier._combine import COMBINED_PREFIX, combine
from checkpointables.training.local_tier._config import LocalTier, RestoreStats
from checkpointables.training.local_tier._exchange import Exchange
from checkpointables.training.local_tier._saves import LocalSaves, local_context
from checkpointables.training.local_tier._store import Store, writer_name
from checkpointables.training.step_info import StepInfo

T = TypeVar("T")
logger = logging.getLogger("checkpointables.training")

__all__ = ["LocalTierRuntime"]

# Loads a persistent step: (the step, the load to start on its path) -> the load's response.
PersistentLoad = Callable[
    [StepInfo, Callable[[epath.Path], AsyncResponse[Any]]], AsyncResponse[Any]
]


def persistent_bytes(path: epath.Path, restored: Any) -> int:
    """What a load of the persistent step at ``path`` read: its files' sizes on a local
    disk; on an object store, the bytes of the arrays restored."""
    if not os.path.isdir(os.fspath(path)):
        import jax

        return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree_util.tree_leaves(restored))
    return sum(
        _size(os.path.join(parent, name))
        for parent, _, names in os.walk(os.fspath(path))
        for name in names
    )


def _size(file: str) -> int:
    # Once the read ended its lease is gone, and retention may be deleting the step now: a
    # statistic must not fail the load that already succeeded.
    try:
        return os.path.getsize(file)
    except FileNotFoundError:
        return 0


# What a local copy that passed its checksums may still raise as it loads (a stray copy, a
# file the checksums do not reach): passed over. A mistake of the caller's (an abstract
# tree that does not match) is not among them: the persistent step would raise it too.
_LOCAL_DAMAGE = (
    errors.IntegrityError,
    errors.MetadataError,
    errors.NotACheckpointError,
    errors.CheckpointNotFoundError,
    errors.OutsideCheckpointError,
)

# The n-th local tier this process opened: the same n on every process, which open the
# same Checkpointers in the same order; it keeps their key-value entries apart.
_opened = itertools.count()


def _make_directory(directory: str) -> None:
    """Creates the tier's directory (and its parents) if missing.

    Raises:
      cp.storage.PathIsAFileError: a file stands at ``directory`` or one of its parents.
    """
    try:
        os.makedirs(directory, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocking = directory
        while not os.path.lexists(blocking) and os.path.dirname(blocking) != blocking:
            blocking = os.path.dirname(blocking)  # Up to the file in the way.
        raise storage.PathIsAFileError(
            errno.ENOTDIR,
            f"The local tier's directory {directory} cannot be made: {blocking} is a file. "
            f"Pass LocalTier a directory (or a path where one can be created) on this "
            f"machine's local disk",
        ) from None


class LocalTierRuntime:
    """See the module's docstring."""

    def __init__(
        self,
        config: LocalTier,
        persistent_root: epath.Path,
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.config = config
        _make_directory(os.fspath(config.directory))
        run, adopted = _owner.claim(os.fspath(config.directory), persistent_root)
        self.store = Store(os.fspath(config.directory), run, adopted)
        self.exchange = Exchange(
            multihost.process_index(), multihost.process_count(), str(next(_opened))
        )
        self._server: _transport.FileServer | None = None
        self._claimed = True
        if self.exchange.count > 1:
            try:
                self._server = _transport.FileServer(self.store.directory, config.serve_address)
            except BaseException:
                self._release()
                raise
        self.saves = LocalSaves(config, self.store, self.exchange, self.address, on_error)
        self._restores = itertools.count()  # The n-th restore: the same on every process.
        self._listings = 0  # complete_steps() calls done: the same on every process.
        self._closes = itertools.count()
        self.last_restore_stats: RestoreStats | None = None

    def address(self) -> str:
        """Where peers fetch this host's files ("" when alone)."""
        return self._server.address if self._server is not None else ""

    def close(self) -> None:
        """Waits for local saves and replication, then (once every process is done
        fetching from this one, or the bound passed) stops serving."""
        try:
            self.saves.close()
        finally:
            if self._server is not None:
                try:
                    self.exchange.all_gather(
                        f"close/{next(self._closes)}", "", self.config.timeout_secs
                    )
                except multihost.BarrierTimeoutError as e:
                    logger.warning("Local tier: closing without every peer: %s", e)
                self._server.close()
            self._release()

    def _release(self) -> None:
        if self._claimed:  # Once: a second close() must not give back another's share.
            self._claimed = False
            _owner.release(self.store.directory)

    def load_async(
        self,
        step: int | None,
        context: Context,
        start: Callable[[epath.Path], AsyncResponse[T]],
        needed_tree: Mapping[str, Any] | None,
        persistent: list[StepInfo],
        load_persistent: PersistentLoad,
    ) -> AsyncResponse[T]:
        """Restores ``step`` (``None``: the newest complete step on any tier) in the background."""
        began = time.perf_counter()
        number = next(self._restores)
        needed = _manifest.needed_shards(needed_tree)
        unsharded = _manifest.unsharded_arrays(needed_tree)
        self.saves.wait_idle()  # What this process saved counts, replicas included.

        def run() -> T:
            name = f"restore/{number}"  # Gathers under it: .../inventory, .../verdict-<step>.
            timeout = self.config.timeout_secs
            inventory = _restore.gather(
                self.store, self.exchange, self.address(), f"{name}/inventory", timeout
            )
            tried = []
            for candidate in _restore.candidates(inventory, persistent, step):
                if candidate.tier == "persistent":
                    assert candidate.info is not None
                    verdict = f"{name}/verdict-persistent-{candidate.step}"
                    loaded = self._load_persistent(
                        candidate.info, start, load_persistent, verdict, step is None
                    )
                    if loaded is None:
                        tried.append(candidate.step)
                        continue
                    nbytes = persistent_bytes(candidate.info.path, loaded[0])
                    self._record(candidate.step, "persistent", 0, 0, nbytes, began)
                    return loaded[0]  # type: ignore[no-any-return]
                verdict = f"{name}/verdict-{candidate.step}"
                obtained = self._obtain(
                    inventory, candidate.step, (needed, unsharded), verdict, context
                )
                loaded = self._load_local(
                    candidate.step, obtained, start, context, f"{verdict}/loaded"
                )
                if obtained is None or loaded is None:
                    tried.append(candidate.step)
                    continue
                result = loaded[0]
                self._record(
                    candidate.step, "local", obtained.bytes_local, obtained.bytes_peers, 0, began
                )
                return result
            which = "" if step is None else f" of step {step}"
            raise StepNotFoundError(
                f"No complete, checksum-valid checkpoint{which} on any tier (local tier "
                f"{self.store.directory}; steps tried, complete but not valid on every "
                f"process: {tried or 'none'}; persistent steps: "
                f"{[i.step for i in persistent] or 'none'})."
            )

        return start_background(run, f"restore of step {step if step is not None else 'latest'}")

    def _load_persistent(
        self,
        info: StepInfo,
        start: Callable[[epath.Path], AsyncResponse[T]],
        load_persistent: PersistentLoad,
        verdict: str,
        may_pass_over: bool,
    ) -> tuple[T] | None:
        """The persistent step ``info``, loaded; ``None`` if it is damaged on some process
        and ``may_pass_over`` (a restore of the newest step moves on to an older one, every
        process together). A damage found loading a step asked for by number is raised."""
        if not may_pass_over:
            return (load_persistent(info, start).result(),)
        result, problem = None, ""
        try:
            result = load_persistent(info, start).result()
        except (errors.IntegrityError, errors.MetadataError) as e:
            problem = f"{type(e).__name__}: {e}"
        if not self._agreed(verdict, problem, f"Persistent step {info.step} is damaged"):
            return None
        return (result,)  # type: ignore[return-value]

    def _load_local(
        self,
        step: int,
        obtained: _restore.Obtained | None,
        start: Callable[[epath.Path], AsyncResponse[T]],
        context: Context,
        verdict: str,
    ) -> tuple[T] | None:
        """The local copy ``obtained`` of ``step``, loaded; ``None`` if it failed to load on
        some process (its checksums held, but it is no checkpoint, or damaged where they do
        not reach): every process then moves on to the next candidate together. ``None``
        at once if some process did not get its copies (``obtained`` is ``None``)."""
        if obtained is None:
            return None
        result, problem = None, ""
        try:
            with local_context(context):
                result = start(epath.Path(obtained.paths[0])).result()
        except _LOCAL_DAMAGE as e:
            problem = f"{obtained.paths[0]}: {type(e).__name__}: {e}"
        if not self._agreed(verdict, problem, f"Local tier: step {step} failed to load"):
            return None
        return (result,)  # type: ignore[return-value]

    def _agreed(self, verdict: str, problem: str, what: str) -> bool:
        """Whether no process had a ``problem`` (all-gathered under ``verdict``); if one
        did, logs ``what`` with each process's."""
        verdicts = self.exchange.all_gather(verdict, problem, self.config.timeout_secs)
        failed = {p: v for p, v in verdicts.items() if v}
        if failed:
            logger.warning("%s; not restored: %s", what, failed)
        return not failed

    def complete_steps(self) -> list[int]:
        """The local steps complete over every host (as a restore decides, checksums
        aside), newest first; the same on every process, which all call it. A local save
        in flight is not waited for: it counts once committed."""
        # Numbered by the calls that succeeded: one made by some processes only (a mistake)
        # times out, and the next one, made by all, is numbered alike on every process.
        name = f"steps/{self._listings}"
        timeout = self.config.timeout_secs
        try:
            inventory = _restore.gather(self.store, self.exchange, self.address(), name, timeout)
        except multihost.BarrierTimeoutError as e:
            self.exchange.retract(name)
            raise multihost.BarrierTimeoutError(
                f"{e} With a local tier, latest_step() asks every process what it holds: call "
                f"it on every process (as every Checkpointer method), not on one alone."
            ) from e
        self._listings += 1
        return inventory.complete_steps()

    def _obtain(
        self,
        inventory: _restore.Inventory,
        step: int,
        asked: tuple[Any, set[str]],
        name: str,
        context: Context,
    ) -> _restore.Obtained | None:
        """The copies of local ``step`` this process needs (``asked``: the shards needed
        and the arrays asked for without a sharding), combined into one checkpoint (the
        path first) if several, when every process got its own (else None)."""
        me, count = self.exchange.me, self.exchange.count
        needed, unsharded = asked
        choices = _restore.options(inventory.holders(step), me, count, needed, unsharded)
        obtained, problem = None, ""
        try:
            obtained = _restore.obtain(
                self.store, inventory, choices, me, self.config.timeout_secs, needed
            )
            if len(obtained.paths) > 1:
                writer = writer_name(me, count)
                target = os.path.join(self.store.step_dir(step), f"{COMBINED_PREFIX}{writer}")
                local = local_context(context)
                with local:
                    combined = combine(obtained.paths, target, local)
                obtained = attrs.evolve(obtained, paths=(combined, *obtained.paths))
        except _transport.FetchError as e:
            problem = str(e) or "no valid copy"
        except (OSError, ValueError, errors.CheckpointError) as e:
            problem = f"combining the copies {obtained.paths if obtained else ''}: {e}"
        if not self._agreed(
            name, problem, f"Local tier: step {step} not restorable from local copies"
        ):
            return None
        return obtained

    def _record(
        self, step: int, tier: str, local: int, peers: int, persistent: int, began: float
    ) -> None:
        secs = time.perf_counter() - began
        self.last_restore_stats = RestoreStats(step, local, peers, persistent, secs, tier)
        logger.info(
            "Restored step %d from the %s tier in %.3f s "
            "(%d B local, %d B from peers, %d B persistent).",
            step,
            tier,
            secs,
            local,
            peers,
            persistent,
        )
