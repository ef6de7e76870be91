"""What each save of a ``Checkpointer`` cost: bytes, time blocked, time to commit.

Every committed save is logged at INFO on ``checkpointables.training`` and
kept as ``Checkpointer.last_save_stats``; a training loop can send it to its
own metrics::

    ckptr.save_pytree_async(step, state)
    ...
    if (stats := ckptr.last_save_stats) is not None:
        wandb.log(stats.as_dict(), step=step)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["SaveStats", "leaves", "array_bytes", "log"]

logger = logging.getLogger("checkpointables.training")


@attrs.frozen
class SaveStats:
    """The cost of one committed save.

    Attributes:
      step: the step saved.
      bytes_written: bytes of array data written (whole arrays, as in the checkpoint),
        not counting those reused. In a multi-process job, the whole checkpoint's: the
        same on every process.
      bytes_reused: bytes of array data linked from the previous step instead of being
        written (``reuse_unchanged``, ``docs/incremental.md``); by every process, as
        ``bytes_written``.
      peak_staging_bytes: the most host memory the save held at once for data on its way
        to storage (device-to-host copies, dtype casts, encoded buffers; not views of CPU
        devices' own buffers, nor the caller's NumPy arrays in a synchronous save), in
        this process; kept within ``cp.options.MemoryOptions.host_bytes`` when a budget
        is set (``docs/memory.md``).
      blocked_secs: how long the ``save_*`` call held the caller (waiting for
        the previous save, then copying device data to host, which waits for the arrays
        to be computed), in this process.
      commit_secs: from the call until the checkpoint was committed, in this process.
    """

    step: int
    bytes_written: int
    blocked_secs: float
    commit_secs: float
    bytes_reused: int = 0
    peak_staging_bytes: int = 0

    def as_dict(self) -> dict[str, float]:
        """The numbers under metric names, e.g. for a metrics logger."""
        return {
            "checkpoint/bytes_written": self.bytes_written,
            "checkpoint/bytes_reused": self.bytes_reused,
            "checkpoint/peak_staging_bytes": self.peak_staging_bytes,
            "checkpoint/blocked_secs": self.blocked_secs,
            "checkpoint/commit_secs": self.commit_secs,
        }


def leaves(checkpointables: Mapping[str, Any]) -> list[Any]:
    """The leaves of ``checkpointables`` as the save saw them (objects that are not pytrees
    are leaves), for ``array_bytes`` to count once the save is in the background."""
    import jax

    return jax.tree_util.tree_leaves(checkpointables)


def array_bytes(leaves: list[Any]) -> int:
    """Bytes of the arrays among ``leaves`` (other objects count 0)."""
    import jax

    total = 0
    for leaf in leaves:
        if isinstance(leaf, jax.Array):  # Its ``nbytes`` is a Python property: the same product.
            total += math.prod(leaf.shape) * leaf.dtype.itemsize
        else:
            total += int(getattr(leaf, "nbytes", 0))
    return total


def log(stats: SaveStats, reused_from: str | None = None) -> None:
    """Logs ``stats`` at INFO (``reused_from``: the name of the step the save reused from,
    said where it reused anything)."""
    logger.info(
        "Saved step %d: %.1f MiB written, %.1f MiB reused%s, %.1f MiB staged at most, "
        "blocked %.3f s, committed after %.3f s.",
        stats.step,
        stats.bytes_written / 2**20,
        stats.bytes_reused / 2**20,
        f" from {reused_from}" if reused_from and stats.bytes_reused else "",
        stats.peak_staging_bytes / 2**20,
        stats.blocked_secs,
        stats.commit_secs,
    )
