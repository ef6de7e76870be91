"""A Checkpointer's cleanup of what killed saves left on an object store never deletes a step
saved since, nor a live save's objects: a save of a step claims it from the cleanup (a
removal still queued is dropped, one running is waited for), and a removal reads the
prefix's record and listing right before deleting, deletes only what it listed, never a
commit marker, and the record only if unchanged (another process's save keeps it).

The races are made deterministic by a proxy that holds one DELETE of the cleanup's."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator

import boto3
import checkpointables as cp
import numpy as np
import pytest
from checkpointables import _leftovers

from ...object_store_server import S3Proxy, S3Server
from .helpers import dead_pid, keys, plant_unfinished


def _state(step: int) -> dict:
    return {"w": np.arange(64.0) + step, "b": np.full(5, step, np.int32)}


class _Gate:
    """Holds the first DELETE whose key contains ``at`` until ``release`` (``arrived`` is
    set when it comes); logs every request as ``(method, key)``."""

    def __init__(self, proxy: S3Proxy, at: str) -> None:
        self.at = at
        self.arrived = threading.Event()
        self.release = threading.Event()
        self.log: list[tuple[str, str]] = []
        proxy.refuse = self._see

    def _see(self, method: str, path: str) -> bool:
        key = path.split("?")[0]
        self.log.append(("LIST" if "list-type=" in path else method, path))
        if method == "DELETE" and self.at in key and not self.arrived.is_set():
            self.arrived.set()
            assert self.release.wait(30)
        return False


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[S3Proxy]:
    proxy = S3Proxy(s3.endpoint)
    yield proxy
    proxy.refuse = lambda method, path: False
    proxy.stop()


def _through(proxy: S3Proxy) -> cp.Context:
    return cp.Context(storage_options=cp.options.StorageOptions(endpoint=proxy.endpoint))


def _committed_run(bucket: str, steps: range) -> str:
    root = f"{bucket}/run"
    with cp.training.Checkpointer(root) as checkpointer:
        for step in steps:
            checkpointer.save_pytree(step, _state(step))
    return root


def _put(s3: S3Server, url: str, data: bytes) -> None:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    boto3.client("s3", endpoint_url=s3.endpoint).put_object(Bucket=bucket, Key=key, Body=data)


def _record_json(pid: int, save_id: str = "planted") -> bytes:
    now = time.time_ns()
    record = {"save_id": save_id, "started_ns": now, "pid": pid, "host": socket.gethostname()}
    return json.dumps({**record, "alive_ns": now}).encode()


def _killed_save_of(s3: S3Server, root: str, step: int) -> None:
    """Makes the committed ``step`` what a save killed before its commit leaves: the same
    objects a new save of it writes, no marker, a record naming a dead process."""
    cp.storage.remove_file(f"{root}/{step}/commit_success.txt")
    _put(s3, f"{root}/{step}/.checkpointables-save", _record_json(dead_pid()))


def _steps(root: str) -> list[int]:
    return [info.step for info in cp.training.Checkpointer(root).steps()]


def test_a_step_saved_again_is_not_removed_by_the_queued_cleanup(s3, bucket, proxy) -> None:
    # The attacker's run (1-4 committed: here 1), two killed saves (10, with many objects,
    # and 5); the restarted loop re-saves 5 while the cleanup is still removing 10.
    root = _committed_run(bucket, range(1, 2))
    plant_unfinished(s3, f"{root}/10", pid=dead_pid())
    for i in range(20):
        _put(s3, f"{root}/10/pytree/d/{i}", b"x")
    plant_unfinished(s3, f"{root}/5", pid=dead_pid())
    gate = _Gate(proxy, "/run/10/")
    with _through(proxy):
        checkpointer = cp.training.Checkpointer(root)
    assert gate.arrived.wait(30)  # The cleanup is removing 10; 5 is still to come.
    assert "pytree/d/junk" in keys(s3, f"{root}/5")
    with _through(proxy):
        assert checkpointer.save_pytree(5, _state(5))
    gate.release.set()
    checkpointer.wait()
    checkpointer.close()
    assert _steps(root) == [1, 5]
    loaded = cp.load_pytree(f"{root}/5", checkpointable_name="state")
    assert np.array_equal(loaded["w"], _state(5)["w"])
    assert keys(s3, f"{root}/10") == []
    assert "pytree/d/junk" not in keys(s3, f"{root}/5")  # The save replaced the leftover.


def test_a_save_waits_for_the_removal_of_its_step_in_progress(s3, bucket, proxy) -> None:
    # The leftover holds the very names the new save writes: a removal still deleting
    # them as the save writes would delete the new save's objects.
    root = _committed_run(bucket, range(5, 6))
    _killed_save_of(s3, root, 5)
    gate = _Gate(proxy, "/run/5/_CHECKPOINT_METADATA")
    with _through(proxy):
        checkpointer = cp.training.Checkpointer(root)
    assert gate.arrived.wait(30)
    held = len(gate.log)
    saved: list[bool] = []
    saving = threading.Thread(target=lambda: saved.append(checkpointer.save_pytree(5, _state(5))))
    with _through(proxy):
        saving.start()
    try:
        saving.join(0.5)  # Long enough for the save to finish, if it did not wait.
        looked = [r for r in gate.log[held:] if "run/5" in r[1] and r[0] != "DELETE"]
        assert saving.is_alive() and not looked  # Waiting before it looks at the step.
    finally:
        gate.release.set()
        saving.join(30)
    assert saved == [True]
    checkpointer.close()
    assert _steps(root) == [5]
    loaded = cp.load_pytree(f"{root}/5", checkpointable_name="state")
    assert np.array_equal(loaded["w"], _state(5)["w"])


def test_a_step_another_process_committed_meanwhile_is_left_alone(s3, bucket, proxy) -> None:
    # A writer the Checkpointer does not know of (another process; here a free function,
    # which claims nothing from it) commits 5 after the cleanup found 5 abandoned.
    root = _committed_run(bucket, range(1, 2))
    plant_unfinished(s3, f"{root}/10", pid=dead_pid())
    plant_unfinished(s3, f"{root}/5", pid=dead_pid())
    gate = _Gate(proxy, "/run/10/")
    with _through(proxy):
        checkpointer = cp.training.Checkpointer(root)
    assert gate.arrived.wait(30)
    cp.save_pytree(f"{root}/5", _state(5))
    gate.release.set()
    checkpointer.close()
    assert _steps(root) == [1, 5]
    assert np.array_equal(cp.load_pytree(f"{root}/5")["w"], _state(5)["w"])
    assert keys(s3, f"{root}/10") == []


def test_a_removal_keeps_a_record_that_changed_and_deletes_it_last(
    s3, bucket, proxy, caplog
) -> None:
    path = f"{bucket}/ck"
    plant_unfinished(s3, path, pid=dead_pid())
    gate = _Gate(proxy, "/ck/pytree/d/junk")
    claimed = _record_json(12345, "another save")
    removing = threading.Thread(target=lambda: _remove_through(proxy, path))
    removing.start()
    assert gate.arrived.wait(30)
    _put(s3, f"{path}/.checkpointables-save", claimed)  # Another process's save claims it.
    with caplog.at_level(logging.WARNING, logger="checkpointables._leftovers"):
        gate.release.set()
        removing.join(30)
    assert keys(s3, path) == [".checkpointables-save"]
    assert cp.storage.read_bytes(f"{path}/.checkpointables-save") == claimed
    assert "A save claimed" in caplog.text and "its record was kept" in caplog.text
    # Unchanged, the record is deleted, after every other object (a crash midway leaves it).
    plant_unfinished(s3, path, pid=dead_pid())
    gate.log.clear()
    gate.arrived.clear()
    gate.release.set()
    _remove_through(proxy, path)
    assert keys(s3, path) == []
    deletes = [path for method, path in gate.log if method == "DELETE"]
    assert len(deletes) == 3 and deletes[-1].endswith("/ck/.checkpointables-save"), gate.log


def _remove_through(proxy: S3Proxy, path: str) -> None:
    with _through(proxy):
        assert _leftovers.remove_unfinished(path)


def test_a_removal_never_deletes_a_committed_checkpoint(s3, bucket, proxy) -> None:
    path = f"{bucket}/ck"
    cp.save_pytree(path, _state(1))
    before = keys(s3, path)
    gate = _Gate(proxy, "/ck/")
    with _through(proxy):
        assert not _leftovers.remove_unfinished(path)
    assert keys(s3, path) == before and not gate.arrived.is_set()
