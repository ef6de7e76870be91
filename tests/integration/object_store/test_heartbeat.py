"""A save still writing to an object store keeps its record's heartbeat fresh: no other
process takes it for a leftover, however long it runs and on whatever host; once it is
killed, its heartbeat goes stale and the next cleanup removes it (docs/object-stores.md)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import checkpointables as cp
import pytest
from checkpointables import _leftovers
from etils import epath

from ...object_store_server import S3Proxy
from ...python_subprocess import wait_for_file

# A save to argv[1] that writes until killed, with AsyncOptions.timeout_secs of argv[3], by a
# process on the host "elsewhere" (what a save on another host sharing the bucket writes).
_SLOW_SAVE = textwrap.dedent(
    """
    import socket, sys, time
    socket.gethostname = lambda: "elsewhere"
    import checkpointables as cp

    class Slow:
        async def save(self, directory):
            async def write():
                await directory.await_creation()
                open(sys.argv[2], "w").close()   # Tell the parent we are mid-save.
                time.sleep(60)
            return write()
        async def load(self, directory):
            return None

    with cp.Context(async_options=cp.options.AsyncOptions(timeout_secs=float(sys.argv[3]))):
        cp.save_checkpointables(sys.argv[1], {"slow": Slow()})
    """
)
_TIMEOUT = 0.5


def _abandoned(path: str) -> bool:
    return bool(_leftovers.abandoned_prefixes([epath.Path(path)], timeout_secs=_TIMEOUT))


def test_another_hosts_save_is_kept_while_its_heartbeat_is_fresh(bucket, tmp_path) -> None:
    path, started = f"{bucket}/ckpt", tmp_path / "started"
    args = [path, str(started), str(_TIMEOUT)]
    with subprocess.Popen([sys.executable, "-c", _SLOW_SAVE, *args]) as proc:
        try:
            wait_for_file(proc, started)
            time.sleep(2 * _TIMEOUT)  # Older than the timeout, still writing.
            record = _leftovers.read_record(path)
            assert record is not None and record.host == "elsewhere"
            assert record.alive_ns is not None and record.alive_ns > record.started_ns
            assert not _abandoned(path)
            with (
                cp.Context(async_options=cp.options.AsyncOptions(timeout_secs=_TIMEOUT)),
                pytest.raises(FileExistsError, match="may still be running"),
            ):
                cp.save_pytree(path, {"v": 1})
        finally:
            proc.kill()
            proc.wait(30)
    assert not _abandoned(path)  # Its pid proves nothing here: its heartbeat must go stale.
    time.sleep(1.5 * _TIMEOUT)
    assert _abandoned(path)
    with cp.Context(async_options=cp.options.AsyncOptions(timeout_secs=_TIMEOUT)):
        cp.save_pytree(path, {"v": 1})  # Replaces the leftover.
    assert cp.load_pytree(path) == {"v": 1}


def test_a_records_heartbeat_decides_whatever_its_age() -> None:
    old = time.time_ns() - 10**13
    record = _leftovers.SaveRecord("s", old, 1, "elsewhere", alive_ns=time.time_ns())
    assert not record.is_abandoned(timeout_secs=60)
    assert _leftovers.SaveRecord.from_json(record.to_json()) == record
    assert _leftovers.SaveRecord.from_json(record.to_json()).alive_ns == record.alive_ns
    assert _leftovers.SaveRecord("s", old, 1, "elsewhere", alive_ns=old).is_abandoned(
        timeout_secs=60
    )
    assert _leftovers.SaveRecord("s", old, 1, "elsewhere").is_abandoned(timeout_secs=60)


def test_a_quick_save_pays_no_heartbeat_a_long_one_one_put_per_interval(s3) -> None:
    proxy = S3Proxy(s3.endpoint)
    try:
        path = f"s3://{s3.new_bucket()}/ckpt"
        options = cp.options.StorageOptions(endpoint=proxy.endpoint)
        with cp.Context(storage_options=options):
            cp.storage.exists(path)  # The store opened before counting.
            with proxy.counting() as quick:
                cp.save_checkpointables(f"{path}-quick", {"slow": _Slow(0)})
            timeout = cp.options.AsyncOptions(timeout_secs=0.4)  # Beats every 0.1 s.
            with cp.Context(async_options=timeout), proxy.counting() as slow:
                cp.save_checkpointables(path, {"slow": _Slow(0.55)})
    finally:
        proxy.stop()
    # About 0.55 / 0.1 beats, each a GET and a PUT of the record (fewer on a busy machine).
    beats = slow.requests["PUT"] - quick.requests["PUT"]
    assert beats in range(2, 7), (quick, slow)
    assert slow.requests["GET"] - quick.requests["GET"] == beats, (quick, slow)


class _Slow:
    """Writes nothing, for ``seconds``, in the background."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def save(self, directory: cp.path.PathAwaitingCreation) -> object:
        async def write() -> None:
            await directory.await_creation()
            time.sleep(self.seconds)

        return write()

    async def load(self, directory: epath.Path) -> None:
        return None
