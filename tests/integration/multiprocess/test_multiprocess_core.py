"""Multi-process saves through the core, with real jax.distributed processes."""

from __future__ import annotations

import os
import signal
import time

import checkpointables as cp
import pytest

from .launcher import run_job

pytestmark = pytest.mark.multiprocess


def test_every_process_saves_and_only_primary_writes_shared_files(tmp_path) -> None:
    body = """
    path = sys.argv[1]
    cp.save_checkpointables(path, {"extra": {"writer": PROCESS_ID}}, custom_metadata={"n": 2})
    # Every process returns only after the commit, so it can load at once.
    print("LOADED", cp.load_checkpointables(path))
    """
    results = [r.check() for r in run_job(body, args=[str(tmp_path / "ckpt")])]
    for r in results:
        assert "LOADED {'extra': {'writer': 0}}" in r.stdout
    assert cp.load_checkpointables(tmp_path / "ckpt") == {"extra": {"writer": 0}}
    assert os.listdir(tmp_path) == ["ckpt"]


def test_other_primary_host(tmp_path) -> None:
    body = """
    with cp.Context(multiprocessing_options=cp.options.MultiprocessingOptions(primary_host=1)):
        cp.save_checkpointables(sys.argv[1], {"extra": {"writer": PROCESS_ID}})
    """
    for r in run_job(body, args=[str(tmp_path / "ckpt")]):
        r.check()
    assert cp.load_checkpointables(tmp_path / "ckpt") == {"extra": {"writer": 1}}


def test_process_local_storage_with_no_primary(tmp_path) -> None:
    body = """
    options = cp.options.MultiprocessingOptions(primary_host=None)
    with cp.Context(multiprocessing_options=options):
        cp.save_checkpointables(sys.argv[1] + f"/local{PROCESS_ID}", {"extra": {"me": PROCESS_ID}})
    """
    for r in run_job(body, args=[str(tmp_path)]):
        r.check()
    assert cp.load_checkpointables(tmp_path / "local0") == {"extra": {"me": 0}}
    assert cp.load_checkpointables(tmp_path / "local1") == {"extra": {"me": 1}}


def test_failure_on_one_process_fails_all_and_commits_nothing(tmp_path) -> None:
    body = """
    class Flaky:
        async def save(self, directory):
            async def write():
                await directory.await_creation()
                if PROCESS_ID == 1:
                    raise OSError("quota exceeded on host 1")
            return write()
        async def load(self, directory):
            return None
    try:
        cp.save_checkpointables(sys.argv[1], {"flaky": Flaky()})
    except Exception as e:
        print("FAILED", type(e).__name__, e)
    """
    results = run_job(body, args=[str(tmp_path / "ckpt")])
    for r in results:
        r.check()
    assert "FAILED OSError quota exceeded on host 1" in results[1].stdout
    assert "FAILED ProcessFailedError" in results[0].stdout
    assert "process 1" in results[0].stdout and "quota exceeded" in results[0].stdout
    assert not (tmp_path / "ckpt").exists()
    assert not any(cp.is_checkpoint(tmp_path / n) for n in os.listdir(tmp_path))


def test_killed_process_makes_survivor_fail_with_timeout_naming_it(tmp_path) -> None:
    body = """
    import time
    class Slow:
        async def save(self, directory):
            async def write():
                await directory.await_creation()
                if PROCESS_ID == 1:
                    open(sys.argv[2], "w").close()
                    time.sleep(120)
            return write()
        async def load(self, directory):
            return None
    with cp.Context(async_options=cp.options.AsyncOptions(timeout_secs=8)):
        try:
            cp.save_checkpointables(sys.argv[1], {"slow": Slow()})
        except Exception as e:
            print("FAILED", type(e).__name__, e, flush=True)
            os._exit(0)  # The coordination service would wait for the dead peer at exit.
    """
    marker = tmp_path / "process1-started"

    def kill_process_1(procs) -> None:
        deadline = time.monotonic() + 90
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGKILL)

    results = run_job(
        body, args=[str(tmp_path / "ckpt"), str(marker)], on_started=kill_process_1, timeout=150
    )
    survivor = results[0]
    assert "FAILED BarrierTimeoutError" in survivor.stdout, (
        survivor.stdout + survivor.stderr[-3000:]
    )
    assert "processes [1]" in survivor.stdout and "written" in survivor.stdout
    assert not (tmp_path / "ckpt").exists()
