"""What the hosts tell each other, through the ``jax.distributed`` key-value store.

Every wait is bounded; a timeout names the processes that did not answer.
Keys live under ``checkpointables/local_tier/<tier>/``, where ``<tier>``
numbers the local tiers this process opened (every process opens the same
ones in the same order); within a tier the n-th collective call is numbered
alike on every process, and a new job has a new store, so keys never collide.
"""

from __future__ import annotations

import time

from checkpointables import multihost

__all__ = ["Exchange"]

_POLL_SECS = 0.02
_PREFIX = "checkpointables/local_tier"


class Exchange:
    """Publishing and gathering small strings between the processes of one job."""

    def __init__(self, process_index: int, process_count: int, namespace: str) -> None:
        self.me = process_index
        self.count = process_count
        self._prefix = f"{_PREFIX}/{namespace}"
        self._client = multihost._client() if process_count > 1 else None

    def publish(self, name: str, value: str) -> None:
        """Publishes this process's ``value`` under ``name``."""
        if self._client is not None:
            key = f"{self._prefix}/{name}/{self.me}"
            self._client.key_value_set(key, value, allow_overwrite=True)  # type: ignore[attr-defined]

    def retract(self, name: str) -> None:
        """Removes what this process published under ``name`` (a gather it gave up on, to
        be tried again under the same name: no peer may read the stale value then)."""
        if self._client is not None:
            self._client.key_value_delete(f"{self._prefix}/{name}/{self.me}")  # type: ignore[attr-defined]

    def get(self, name: str, process: int, timeout: float) -> str:
        """What ``process`` published under ``name``, waiting at most ``timeout`` seconds.

        Raises:
          multihost.BarrierTimeoutError: naming the process that did not answer.
        """
        assert self._client is not None
        try:
            return str(
                self._client.blocking_key_value_get(  # type: ignore[attr-defined]
                    f"{self._prefix}/{name}/{process}", int(timeout * 1000)
                )
            )
        except Exception as e:
            raise multihost.BarrierTimeoutError(
                f"Local tier: process {process} did not publish {name!r} within {timeout:g} s "
                f"(it may have died or be stuck): {e}"
            ) from e

    def all_gather(self, name: str, value: str, timeout: float) -> dict[int, str]:
        """Every process's ``value`` under ``name`` (this one's included).

        Raises:
          multihost.BarrierTimeoutError: naming the processes that did not answer.
        """
        if self._client is None:
            return {self.me: value}
        self.publish(name, value)
        deadline = time.monotonic() + timeout
        while True:
            entries = self._client.key_value_dir_get(f"{self._prefix}/{name}/")  # type: ignore[attr-defined]
            found = {int(k.rsplit("/", 1)[-1]): str(v) for k, v in entries}
            missing = [p for p in range(self.count) if p not in found]
            if not missing:
                return found
            if time.monotonic() > deadline:
                raise multihost.BarrierTimeoutError(
                    f"Local tier: timed out after {timeout:g} s gathering {name!r}: processes "
                    f"{missing} of {list(range(self.count))} did not answer (they may have died "
                    f"or be stuck). Raise LocalTier(timeout_secs=...) if they are only slow."
                )
            time.sleep(_POLL_SECS)
