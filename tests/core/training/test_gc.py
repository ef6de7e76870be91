"""Garbage collection of old steps, and cleanup of what crashed runs leave behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import checkpointables as cp
import pytest

from ...python_subprocess import wait_for_file
from .helpers import TIMEOUT, Value, load_value

D = cp.training.save_decision_policies
P = cp.training.preservation_policies
EVERY_STEP = D.EveryNStepsPolicy(1)


def on_disk(root) -> list[str]:
    return sorted(os.listdir(root), key=lambda n: (len(n), n))


def test_latest_n_deletes_old_steps(tmp_path) -> None:
    with cp.training.Checkpointer(
        tmp_path, save_decision_policy=EVERY_STEP, preservation_policy=P.LatestN(2)
    ) as ckptr:
        for step in range(6):
            ckptr.save_checkpointables_async(step, {"extra": {"step": step}})
        ckptr.wait()
        assert [s.step for s in ckptr.steps()] == [4, 5]
        assert on_disk(tmp_path) == ["4", "5"]
        assert ckptr.load_checkpointables(4) == {"extra": {"step": 4}}


def test_issue_example_keeps_latest_and_best(tmp_path) -> None:
    keep = P.AnyPreservationPolicy(
        [P.LatestN(3), P.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=2)]
    )
    losses = [0.9, 0.1, 0.8, 0.2, 0.7, 0.6, 0.5]
    with cp.training.Checkpointer(
        tmp_path, save_decision_policy=EVERY_STEP, preservation_policy=keep
    ) as ckptr:
        for step, loss in enumerate(losses):
            ckptr.save_checkpointables(step, {"extra": {}}, metrics={"loss": loss})
    assert on_disk(tmp_path) == ["1", "3", "4", "5", "6"]
    assert [s.step for s in cp.training.Checkpointer(tmp_path).steps()] == [1, 3, 4, 5, 6]


def test_the_latest_step_is_always_kept(tmp_path) -> None:
    class KeepNothing:
        def should_preserve(self, steps, *, context):
            return [False] * len(steps)

    with cp.training.Checkpointer(
        tmp_path, save_decision_policy=EVERY_STEP, preservation_policy=KeepNothing()
    ) as ckptr:
        for step in range(3):
            ckptr.save_checkpointables(step, {"extra": {}})
            ckptr.wait()
            assert on_disk(tmp_path) == [str(step)]
            assert [s.step for s in ckptr.steps()] == [step]


def test_a_step_being_read_is_deleted_only_after_the_read(tmp_path) -> None:
    ckptr = cp.training.Checkpointer(
        tmp_path, save_decision_policy=EVERY_STEP, preservation_policy=P.LatestN(1)
    )
    ckptr.save_checkpointables(0, {"v": Value(0)})
    gate = threading.Event()
    reader = Value(load_gate=gate)
    loading = ckptr.load_checkpointables_async(0, {"v": reader})
    assert reader.reading.wait(TIMEOUT)
    for step in (1, 2):
        ckptr.save_checkpointables(step, {"v": Value(step)})
    ckptr.wait()
    # Step 1 went; step 0 is still being read, so it stays (but no longer counts as kept).
    assert on_disk(tmp_path) == ["0", "2"]
    gate.set()
    assert loading.result()["v"].value == 0
    ckptr.wait()
    assert on_disk(tmp_path) == ["2"]
    assert [s.step for s in ckptr.steps()] == [2]
    ckptr.close()


def test_gc_never_blocks_a_save(tmp_path) -> None:
    deciding, release = threading.Event(), threading.Event()

    class SlowPolicy:  # Stands for a slow deletion: GC is busy until released.
        def should_preserve(self, steps, *, context):
            deciding.set()
            assert release.wait(TIMEOUT)
            return [s.step % 2 == 0 for s in steps]

    ckptr = cp.training.Checkpointer(
        tmp_path, save_decision_policy=EVERY_STEP, preservation_policy=SlowPolicy()
    )
    ckptr.save_checkpointables(0, {"extra": {}})
    ckptr.save_checkpointables(1, {"extra": {}})
    assert deciding.wait(TIMEOUT)
    # GC is stuck; saves and loads go on.
    for step in (2, 3, 4):
        assert ckptr.save_checkpointables(step, {"extra": {"step": step}})
    assert ckptr.load_checkpointables(3) == {"extra": {"step": 3}}
    assert on_disk(tmp_path) == ["0", "1", "2", "3", "4"]
    release.set()
    ckptr.wait()
    assert on_disk(tmp_path) == ["0", "2", "4"]
    ckptr.close()


def test_preservation_failures_surface_and_delete_nothing(tmp_path) -> None:
    class Broken:
        def should_preserve(self, steps, *, context):
            return [True]  # Wrong length.

    ckptr = cp.training.Checkpointer(
        tmp_path, save_decision_policy=EVERY_STEP, preservation_policy=Broken()
    )
    ckptr.save_checkpointables(0, {"extra": {}})
    ckptr.save_checkpointables(1, {"extra": {}})
    with pytest.raises(ValueError, match="returned 1 decisions for 2 steps"):
        ckptr.wait()
    assert on_disk(tmp_path) == ["0", "1"]
    ckptr.close()


def test_gc_deletes_by_renaming_away_first(tmp_path) -> None:
    """A step whose deletion was cut short is never listed and is cleaned up later."""
    ckptr = cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP)
    ckptr.save_checkpointables(0, {"v": Value(0)})
    ckptr.save_checkpointables(1, {"v": Value(1)})
    # What a crash mid-deletion leaves: step 0 renamed away by a dead process, half removed.
    dead = _dead_pid()
    half_deleted = tmp_path / f"0.checkpointables-old-{time.time_ns()}-{dead}-0123abcd"
    os.rename(tmp_path / "0", half_deleted)
    (half_deleted / "v" / "value.txt").unlink()
    fresh = cp.training.Checkpointer(tmp_path)
    assert [s.step for s in fresh.steps()] == [1]
    fresh.wait()
    assert on_disk(tmp_path) == ["1"]
    assert load_value(fresh) == 1


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_cleanup_removes_only_provably_abandoned_entries(tmp_path) -> None:
    now = time.time_ns()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        names = {
            "dead": f"3.checkpointables-tmp-{now}-{_dead_pid()}-aaaaaaaa",
            "live": f"4.checkpointables-tmp-{now}-{alive.pid}-bbbbbbbb",
            "mine": f"5.checkpointables-tmp-{now}-{os.getpid()}-cccccccc",
            "old_live": f"6.checkpointables-tmp-{now - 3_600 * 10**9}-{alive.pid}-dddddddd",
            "orbax": "7.orbax-checkpoint-tmp-1700000000",
        }
        for name in names.values():
            (tmp_path / name).mkdir()
            (tmp_path / name / "data").write_text("x")
        (tmp_path / "metadata").mkdir()
        stale_file = f"_ROOT_METADATA.checkpointables-tmp-{now}-{_dead_pid()}-eeeeeeee"
        (tmp_path / "metadata" / stale_file).write_text("{}")
        timeout = cp.options.AsyncOptions(timeout_secs=1_800)
        with cp.training.Checkpointer(tmp_path, context=cp.Context(async_options=timeout)):
            pass  # Exiting waits for the cleanup.
        remaining = set(os.listdir(tmp_path))
        assert remaining == {names["live"], names["mine"], names["orbax"], "metadata"}
        assert os.listdir(tmp_path / "metadata") == []
    finally:
        alive.kill()
        alive.wait()


_SLOW_SAVER = textwrap.dedent(
    """
    import os, sys, time
    import checkpointables as cp

    class Slow:
        async def save(self, directory):
            async def write():
                path = await directory.await_creation()
                (path / "data").write_text("payload")
                open(sys.argv[2], "w").close()          # Mid-save: tell the parent.
                while not os.path.exists(sys.argv[3]):  # Wait to be released.
                    time.sleep(0.01)
            return write()
        async def load(self, directory):
            async def read():
                self.data = (directory / "data").read_text()
            return read()

    ckptr = cp.training.Checkpointer(sys.argv[1])
    assert ckptr.save_checkpointables(7, {"slow": Slow()})
    """
)


def test_a_live_process_in_flight_save_is_left_alone(tmp_path) -> None:
    root, started, release = tmp_path / "root", tmp_path / "started", tmp_path / "release"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_SAVER, str(root), str(started), str(release)]
    )
    try:
        wait_for_file(proc, started, TIMEOUT)
        (in_flight,) = os.listdir(root)
        assert ".checkpointables-tmp-" in in_flight
        ckptr = cp.training.Checkpointer(root)
        ckptr.wait()
        assert os.listdir(root) == [in_flight] and ckptr.steps() == []
        release.touch()
        assert proc.wait(TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ckptr.reload()
    assert [s.step for s in ckptr.steps()] == [7]
    assert (root / "7" / "slow" / "data").read_text() == "payload"


def test_deletion_survives_steps_removed_behind_its_back(tmp_path) -> None:
    ckptr = cp.training.Checkpointer(
        tmp_path, save_decision_policy=EVERY_STEP, preservation_policy=P.LatestN(1)
    )
    ckptr.save_checkpointables(0, {"extra": {}})
    shutil.rmtree(tmp_path / "0")  # Someone else deleted it.
    ckptr.save_checkpointables(1, {"extra": {}})
    ckptr.wait()
    assert [s.step for s in ckptr.steps()] == [1]
    with pytest.raises(cp.training.errors.StepNotFoundError):
        ckptr.load_checkpointables(0)
    ckptr.close()
