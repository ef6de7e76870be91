"""The Checkpointer's front doors over two tiers: which tier a save goes to, what ``steps``
lists, and the restore statistics of a Checkpointer without a local tier."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from etils import epath

from checkpointables import errors
from checkpointables._asyncio import AsyncResponse, start_background
from checkpointables.context import Context
from checkpointables.training._saves import Saves, StepSave
from checkpointables.training.errors import StepNotFoundError
from checkpointables.training.local_tier._config import LocalTier, RestoreStats
from checkpointables.training.local_tier._saves import local_context
from checkpointables.training.local_tier._tier import LocalTierRuntime, persistent_bytes
from checkpointables.training.step_info import StepInfo

T = TypeVar("T")

__all__ = ["open_tier", "steps", "latest", "save", "timed", "local_metadata"]

TIERS = (None, "local", "persistent")


def open_tier(
    config: LocalTier | None,
    persistent_root: epath.Path,
    on_error: Callable[[BaseException], None],
) -> LocalTierRuntime | None:
    """The local tier ``config`` describes, serving the Checkpointer of ``persistent_root``,
    started (``None``: no local tier)."""
    if config is None:
        return None
    if not isinstance(config, LocalTier):
        raise errors.InvalidArgumentTypeError(
            f"Checkpointer(local_tier={config!r}): expected a cp.training.LocalTier, e.g. "
            f"cp.training.LocalTier('/local/ckpt', replicas=1, keep=2)."
        )
    return LocalTierRuntime(config, persistent_root, on_error)


def steps(
    persistent: list[StepInfo], local: LocalTierRuntime | None, tier: str | None
) -> list[StepInfo]:
    """The steps ``Checkpointer.steps(tier)`` lists, sorted by step."""
    if tier not in TIERS:
        raise errors.InvalidArgumentError(
            f"steps(tier={tier!r}): expected None (every tier), 'local' or 'persistent'."
        )
    if tier == "persistent" or local is None:
        if tier == "local":
            return []
        return persistent
    held = local.saves.steps()
    if tier == "local":
        return held
    merged = {info.step: info for info in held}
    merged.update({info.step: info for info in persistent})
    return [merged[s] for s in sorted(merged)]


def latest(persistent: list[StepInfo], local: LocalTierRuntime | None) -> StepInfo | None:
    """The step ``Checkpointer.latest_step()`` names: the newest persistent one, or the
    newest local one complete over every host if newer (one all-gather)."""
    newest = persistent[-1] if persistent else None
    if local is None:
        return newest
    complete = local.complete_steps()
    if not complete or (newest is not None and newest.step >= complete[0]):
        return newest
    held = {info.step: info for info in local.saves.steps()}
    return held.get(complete[0], StepInfo(step=complete[0], path=local.store.step_dir(complete[0])))


def save(
    request: StepSave, context: Context, persistent: Saves, local: LocalTierRuntime | None
) -> AsyncResponse[bool]:
    """Starts the save of ``request`` on each tier whose policy chooses it (both if forced);
    the response is True once every save started has committed, False if none started."""
    if local is None:
        return persistent.start(request, context)
    # What the persistent tier would refuse (a step it saves that exists, an earlier
    # save's error) is refused before the local save replaces its copy of the step. The
    # local save starts first: it commits while the persistent one may still be writing.
    persistent_chosen = request.force or persistent.decide(request.step, context)
    local_save = None
    if request.force or local.saves.decide(request.step, context):
        if persistent_chosen:
            persistent.refuse_existing(request, context)
        local_save = local.saves.start(request, context)
    persistent_save = persistent.start(request, context, decided=persistent_chosen)
    if local_save is None:
        return persistent_save

    def both() -> bool:
        persistent_save.result()
        return local_save.result()

    return start_background(both, f"save of step {request.step} (local and persistent tiers)")


def timed(
    response: AsyncResponse[T], info: StepInfo, record: Callable[[RestoreStats], None]
) -> AsyncResponse[T]:
    """``response``, recording its ``RestoreStats`` (a persistent load) once it is done."""
    began = time.perf_counter()

    def finish() -> T:
        result = response.result()
        nbytes = persistent_bytes(info.path, result)
        record(RestoreStats(info.step, 0, 0, nbytes, time.perf_counter() - began, "persistent"))
        return result

    return start_background(finish, f"load of step {info.step}", daemon=True)


def local_metadata(
    local: LocalTierRuntime,
    step: int,
    context: Context,
    read: Callable[[epath.Path], T],
    missing: StepNotFoundError,
) -> T:
    """``read(path)`` of this host's copy of ``step``, a step the persistent tier does not
    hold (``missing``: what it raised); its copy is an ordinary checkpoint.

    Raises:
      cp.training.errors.StepNotFoundError: no whole copy of ``step`` on this host.
    """
    # Saves come from this thread: once the one in flight, its replication and retention
    # are done, nothing removes the copy while it is read.
    local.saves.wait_idle()
    info = local.saves.whole_copy(step)
    if info is None:
        held = [s.step for s in local.saves.steps()]
        where = (
            "holds only other processes' small items of it here (a partial copy)"
            if step in held
            else f"has no copy of it on this host (local steps here: "
            f"{', '.join(map(str, held)) or 'none'})"
        )
        raise StepNotFoundError(
            f"{missing} The local tier ({local.store.directory}) {where}: the metadata of a "
            f"local step is read from a whole copy on this host (load_*({step}) also fetches "
            f"one from the hosts that hold it)."
        ) from None
    with local_context(context):
        return read(epath.Path(info.path))
