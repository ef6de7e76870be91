"""A store that stops answering in the middle of a save.

A proxy in front of the S3 server forwards requests until the save reaches
a chosen object, then answers nothing more (as a server that hangs, or a
network that goes silent). The save must raise ``cp.errors.StorageError``
within ``StorageOptions.request_timeout_secs``, without spending another
timeout on asking the silent store to discard what it wrote; that leftover
must never pass for a checkpoint, an earlier checkpoint stays whole, and the
next cleanup that finds it abandoned removes it (docs/object-stores.md).
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Iterator

import checkpointables as cp
import numpy as np
import pytest

from ...object_store_server import S3Proxy, S3Server
from .helpers import assert_equal, keys

_TIMEOUT_SECS = 1.0


class StallingProxy(S3Proxy):
    """Forwards requests until one for a key ending in ``stall_at``; from then on answers
    none (they wait until the proxy stops). ``forward_stalled``: the first stalled request
    still reaches the server (its answer is what gets lost)."""

    def __init__(self, target: str, stall_at: str, *, forward_stalled: bool = False) -> None:
        self.stall_at = stall_at
        self.forward_stalled = forward_stalled
        self.stalled_at: float | None = None  # time.monotonic() of the first stalled request.
        self._released = threading.Event()
        super().__init__(target)

    def stop(self) -> None:
        """Lets the stalled requests go (unanswered), then stops serving."""
        self._released.set()
        super().stop()

    def _handler(self) -> type:
        proxy = self
        base = super()._handler()

        class Stalling(base):  # type: ignore[misc, valid-type]
            def _stall(self) -> None:
                first = proxy.stalled_at is None
                if first:
                    proxy.stalled_at = time.monotonic()
                body = self._body()
                if first and proxy.forward_stalled:
                    connection = http.client.HTTPConnection(proxy._target, timeout=30)
                    headers = {
                        k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"
                    }
                    headers["Content-Length"] = str(len(body))
                    connection.request(self.command, self.path, body=body, headers=headers)
                    connection.getresponse().read()
                    connection.close()
                proxy._released.wait()
                self._drop()

            def _forward(self) -> None:
                if proxy.stalled_at is not None or self.path.split("?")[0].endswith(proxy.stall_at):
                    self._stall()
                else:
                    super()._forward()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        return Stalling


@pytest.fixture
def stalling(s3: S3Server) -> Iterator[list[StallingProxy]]:
    proxies: list[StallingProxy] = []
    yield proxies
    for proxy in proxies:
        proxy.stop()


def _tree(version: int) -> dict:
    return {"w": np.arange(4096, dtype=np.float32) + version, "step": version}


def _save_then_stall(
    s3: S3Server, bucket: str, proxies: list[StallingProxy], stall_at: str, **kwargs: bool
) -> float:
    """Saves step 0, then step 1 until the store stops answering at ``stall_at``; returns
    how long the failed save took once the store went silent."""
    proxy = StallingProxy(s3.endpoint, stall_at=f"/1/{stall_at}", **kwargs)
    proxies.append(proxy)
    through_proxy = cp.options.StorageOptions(
        endpoint=proxy.endpoint, request_timeout_secs=_TIMEOUT_SECS, request_retries=1
    )
    with cp.Context(storage_options=through_proxy):
        cp.save_pytree(f"{bucket}/0", _tree(0))
        with pytest.raises(cp.errors.StorageError, match="request_timeout_secs"):
            cp.save_pytree(f"{bucket}/1", _tree(1))
    assert proxy.stalled_at is not None, "the save never reached the stalled object"
    return time.monotonic() - proxy.stalled_at


def test_a_save_whose_store_goes_silent_fails_in_time_and_commits_nothing(
    s3, bucket, stalling
) -> None:
    # Silent from the metadata on: the arrays, orbax.checkpoint and the record were written.
    took = _save_then_stall(s3, bucket, stalling, "_CHECKPOINT_METADATA")
    # One timeout, not two: the discard does not ask the silent store again.
    assert took < 1.9 * _TIMEOUT_SECS, took
    assert keys(s3, f"{bucket}/1"), "the failed save left its objects (nobody could delete them)"
    with cp.Context(storage_options=cp.options.StorageOptions(endpoint=s3.endpoint)):
        assert not cp.is_checkpoint(f"{bucket}/1")
        with pytest.raises(cp.errors.NotACheckpointError):
            cp.load_pytree(f"{bucket}/1")
        assert cp.is_checkpoint(f"{bucket}/0")
        assert_equal(cp.load_pytree(f"{bucket}/0"), _tree(0))
        # Its record names this process, alive: a save without overwrite may not replace it.
        with pytest.raises(cp.errors.CheckpointExistsError, match="may still be running"):
            cp.save_pytree(f"{bucket}/1", _tree(1))
    # The next cleanup that finds the save abandoned (older than AsyncOptions.timeout_secs:
    # this process is alive) removes its objects; the earlier step stays.
    cleanup = cp.Context(
        storage_options=cp.options.StorageOptions(endpoint=s3.endpoint),
        async_options=cp.options.AsyncOptions(timeout_secs=_TIMEOUT_SECS),
    )
    with cleanup, cp.training.Checkpointer(bucket) as checkpointer:
        assert [s.step for s in checkpointer.steps()] == [0]
    assert keys(s3, f"{bucket}/1") == []
    assert keys(s3, f"{bucket}/0")


def test_a_save_whose_commit_landed_but_was_not_answered_is_whole(s3, bucket, stalling) -> None:
    # The marker's PUT reaches the server; its answer is lost: the save raises, the step is
    # committed and whole (docs/object-stores.md, "When the store cannot be reached").
    took = _save_then_stall(s3, bucket, stalling, "commit_success.txt", forward_stalled=True)
    assert took < 1.9 * _TIMEOUT_SECS, took
    with cp.Context(storage_options=cp.options.StorageOptions(endpoint=s3.endpoint)):
        for step in (0, 1):
            assert cp.is_checkpoint(f"{bucket}/{step}")
            assert_equal(cp.load_pytree(f"{bucket}/{step}"), _tree(step))
