"""The local tier against what users and accidents do: a directory shared by two runs or
equal to the root, a step saved twice, a rollback, a manifest copied over another, a
damaged persistent step above an intact local one."""

from __future__ import annotations

import glob
import shutil

import checkpointables as cp
import numpy as np
import pytest

from .test_local_tier import checkpointer, flip_a_bit, run, state

EveryN = cp.training.save_decision_policies.EveryNStepsPolicy


def _w(restored) -> float:
    return float(np.asarray(restored["w"])[0, 0])


def test_a_local_directory_serves_one_run(tmp_path, monkeypatch) -> None:
    tier = cp.training.LocalTier(tmp_path / "local", save_decision_policy=EveryN(10))
    with cp.training.Checkpointer(tmp_path / "model", local_tier=tier) as ckptr:
        ckptr.save_pytree(10, state(10))
    # The same directory for another Checkpointer (an EMA's, a new run's): its steps are
    # restored by number, so it is refused, naming both roots.
    with pytest.raises(cp.errors.InvalidArgumentError, match="model.*not of .*ema"):
        cp.training.Checkpointer(tmp_path / "ema", local_tier=tier)
    # Its own Checkpointer, reopened (here through a relative path): still its directory.
    monkeypatch.chdir(tmp_path)
    with cp.training.Checkpointer("model", local_tier=tier) as ckptr:
        assert _w(ckptr.load_pytree()) == 10
    # The root itself, or a directory holding it: the local tier's retention would delete
    # its steps.
    for local in (tmp_path / "model", tmp_path):
        with pytest.raises(cp.errors.InvalidArgumentError, match="is, or holds, the Checkpointer"):
            cp.training.Checkpointer(tmp_path / "model", local_tier=cp.training.LocalTier(local))
    assert [s.step for s in cp.training.Checkpointer(tmp_path / "model").steps()] == [10]


def test_a_refused_save_leaves_the_local_copy_as_it_was(tmp_path) -> None:
    with checkpointer(tmp_path, persistent=10, local=10) as ckptr:
        run(ckptr, range(0, 31))
        with pytest.raises(cp.training.errors.StepAlreadyExistsError):
            ckptr.save_pytree(30, state(-999))
        assert _w(ckptr.load_pytree(30)) == 30 and ckptr.last_restore_stats.tier == "local"
        ckptr.save_pytree(30, state(-999), overwrite=True)  # Asked for: both tiers replaced.
        assert _w(ckptr.load_pytree(30)) == -999
        assert _w(cp.load_pytree(tmp_path / "persistent" / "30")) == -999


def test_after_a_rollback_the_new_trajectory_is_kept_and_restored(tmp_path) -> None:
    with checkpointer(tmp_path, persistent=100, local=10, keep=2) as ckptr:
        run(ckptr, range(0, 231))
        assert _w(ckptr.load_pytree(200)) == 200  # Back to 200, then another trajectory.
        for step in range(201, 216):
            ckptr.save_pytree(step, state(-step))
        assert [s.step for s in ckptr.steps(tier="local")] == [210]  # 220, 230: left behind.
        assert ckptr.latest_step().step == 210
    with checkpointer(tmp_path) as ckptr:
        assert _w(ckptr.load_pytree()) == -210
        assert ckptr.last_restore_stats.step == 210


def test_a_manifest_copied_over_another_steps_is_not_used(tmp_path) -> None:
    with checkpointer(tmp_path) as ckptr:
        run(ckptr, range(0, 231))
    local = tmp_path / "local"
    stale = local / "220" / "p0-of-1.manifest.json"
    shutil.copyfile(stale, local / "230" / "p0-of-1.manifest.json")
    with checkpointer(tmp_path) as ckptr:
        assert [s.step for s in ckptr.steps(tier="local")] == [220]
        assert _w(ckptr.load_pytree()) == 220 and ckptr.last_restore_stats.step == 220
        with pytest.raises(cp.training.errors.StepNotFoundError):
            ckptr.load_pytree(230)


def test_a_damaged_newest_persistent_step_gives_way_to_an_intact_local_one(
    tmp_path, caplog
) -> None:
    with checkpointer(tmp_path, persistent=10, local=3) as ckptr:
        run(ckptr, range(0, 41))
        assert [s.step for s in ckptr.steps(tier="local")] == [36, 39]
    flip_a_bit(max(glob.glob(f"{tmp_path}/persistent/40/*/d"), key=len))
    with checkpointer(tmp_path, persistent=10, local=3) as ckptr:
        assert _w(ckptr.load_pytree()) == 39 and ckptr.last_restore_stats.tier == "local"
        assert "Persistent step 40 is damaged" in caplog.text
        with pytest.raises(cp.errors.IntegrityError):  # Asked for by number: the damage.
            ckptr.load_pytree(40)


_HOLDER = """
import sys, time
import checkpointables as cp
tier = cp.training.LocalTier(sys.argv[2])
with cp.training.Checkpointer(sys.argv[1], local_tier=tier):
    print("open", flush=True)
    time.sleep(600)
"""


def test_a_local_directory_is_used_by_one_process_at_a_time(tmp_path) -> None:
    import subprocess
    import sys

    root, local = tmp_path / "persistent", tmp_path / "local"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(root), str(local)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "open\n"
        with pytest.raises(cp.errors.InvalidArgumentError, match="in use by another process"):
            cp.training.Checkpointer(root, local_tier=cp.training.LocalTier(local))
    finally:
        holder.kill()
        holder.communicate(timeout=30)
    # Its process gone (killed: its lock went with it), the directory is this one's. Two
    # Checkpointers of one process share it; the lock stays until both are closed.
    first = cp.training.Checkpointer(root, local_tier=cp.training.LocalTier(local))
    second = cp.training.Checkpointer(root, local_tier=cp.training.LocalTier(local))
    first.close()
    first.close()  # Twice: gives back nothing more.
    probe = [
        sys.executable,
        "-c",
        _HOLDER.replace("time.sleep(600)", "pass"),
        str(root),
        str(local),
    ]
    refused = subprocess.run(probe, capture_output=True, text=True)
    assert refused.returncode != 0 and "in use by another process" in refused.stderr
    second.close()
    assert subprocess.run(probe, capture_output=True, text=True).stdout == "open\n"


def test_a_step_the_persistent_tier_skips_is_saved_locally_even_if_it_holds_it(tmp_path) -> None:
    # An earlier run left persistent steps 0-60; this one saves there every 100 steps only,
    # and goes back to 30: steps 40-60 are the local tier's to save (the persistent one
    # would not save them, so it refuses nothing).
    with checkpointer(tmp_path, persistent=10, local=1000) as ckptr:
        run(ckptr, range(0, 61))
    with checkpointer(tmp_path, persistent=100, local=5) as ckptr:
        assert _w(ckptr.load_pytree(30)) == 30
        for step in range(31, 66):
            ckptr.save_pytree(step, state(-step))
        assert [s.step for s in ckptr.steps(tier="local")] == [60, 65]
        assert _w(ckptr.load_pytree(60)) == -60 and ckptr.last_restore_stats.tier == "local"
