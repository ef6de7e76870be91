"""The local tier in one process: its cadence and retention, listing per tier, the restore
rule over both tiers, every kind of checkpointable, and damaged copies."""

from __future__ import annotations

import os

import checkpointables as cp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpointables.training.local_tier._owner import LOCK_FILE, OWNER_FILE

EveryN = cp.training.save_decision_policies.EveryNStepsPolicy


def state(step: int) -> dict:
    return {
        "w": jnp.arange(12.0).reshape(3, 4) + step,
        "b": np.full(5, step, np.int32),
        "step": step,
    }


def abstract() -> dict:
    s = state(0)
    return {
        "w": jax.ShapeDtypeStruct(s["w"].shape, s["w"].dtype, sharding=s["w"].sharding),
        "b": np.empty(5, np.int32),
        "step": 0,
    }


def checkpointer(tmp_path, *, persistent=100, local=10, keep=2, **kw) -> cp.training.Checkpointer:
    return cp.training.Checkpointer(
        tmp_path / "persistent",
        save_decision_policy=EveryN(persistent),
        local_tier=cp.training.LocalTier(
            tmp_path / "local", save_decision_policy=EveryN(local), keep=keep, **kw
        ),
    )


def run(ckptr: cp.training.Checkpointer, steps: range) -> None:
    for step in steps:
        ckptr.save_pytree(step, state(step))


def flip_a_bit(directory) -> str:
    """Flips one bit of the largest file under ``directory``; returns its path."""
    files = [os.path.join(p, n) for p, _, names in os.walk(directory) for n in names]
    victim = max(files, key=os.path.getsize)
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    return victim


def test_each_tier_saves_at_its_own_cadence_and_keeps_its_own_retention(tmp_path) -> None:
    with checkpointer(tmp_path, keep=2) as ckptr:
        run(ckptr, range(0, 231))
        assert [s.step for s in ckptr.steps(tier="persistent")] == [0, 100, 200]
        assert [s.step for s in ckptr.steps(tier="local")] == [220, 230]
        assert [s.step for s in ckptr.steps()] == [0, 100, 200, 220, 230]
        assert ckptr.latest_step().step == 230
    # Each local step is an ordinary checkpoint of this host's shards.
    copy = tmp_path / "local" / "230" / "p0-of-1"
    assert cp.load_pytree(copy)["step"] == 230
    assert sorted(os.listdir(tmp_path / "local")) == [OWNER_FILE, LOCK_FILE, "220", "230"]
    # The persistent tier is unchanged: an ordinary Checkpointer reads it.
    with cp.training.Checkpointer(tmp_path / "persistent") as plain:
        assert [s.step for s in plain.steps()] == [0, 100, 200]


def test_restore_reads_the_newest_step_on_any_tier(tmp_path) -> None:
    with checkpointer(tmp_path) as ckptr:
        run(ckptr, range(0, 125))
    with checkpointer(tmp_path) as ckptr:
        restored = ckptr.load_pytree(None, abstract())
        stats = ckptr.last_restore_stats
    assert restored["step"] == 120
    np.testing.assert_array_equal(restored["w"], state(120)["w"])
    assert (stats.step, stats.tier, stats.bytes_from_persistent, stats.bytes_from_peers) == (
        120,
        "local",
        0,
        0,
    )
    assert stats.bytes_from_local > 0 and stats.secs > 0


def test_a_newer_persistent_step_wins_over_an_older_local_one(tmp_path) -> None:
    with checkpointer(tmp_path, persistent=7, local=10) as ckptr:
        run(ckptr, range(0, 22))
    with checkpointer(tmp_path, persistent=7, local=10) as ckptr:
        assert ckptr.load_pytree()["step"] == 21
        stats = ckptr.last_restore_stats
    assert (stats.step, stats.tier, stats.bytes_from_local) == (21, "persistent", 0)
    assert stats.bytes_from_persistent > 0


def test_an_explicit_step_is_read_from_the_tier_that_holds_it(tmp_path) -> None:
    with checkpointer(tmp_path) as ckptr:
        run(ckptr, range(0, 101))
        assert ckptr.load_pytree(100)["step"] == 100
        assert ckptr.last_restore_stats.tier == "local"  # On both tiers: local is faster.
        assert ckptr.load_pytree(0)["step"] == 0
        assert ckptr.last_restore_stats.tier == "persistent"
        with pytest.raises(cp.training.errors.StepNotFoundError, match="step 50"):
            ckptr.load_pytree(50)


def test_a_damaged_local_copy_falls_back_to_the_next_valid_one(tmp_path) -> None:
    with checkpointer(tmp_path) as ckptr:
        run(ckptr, range(0, 121))
    flip_a_bit(tmp_path / "local" / "120" / "p0-of-1")
    with checkpointer(tmp_path) as ckptr:
        assert ckptr.load_pytree(None, abstract())["step"] == 110  # Not the damaged 120.
        assert ckptr.last_restore_stats.tier == "local"
    flip_a_bit(tmp_path / "local" / "110" / "p0-of-1")
    with checkpointer(tmp_path) as ckptr:
        assert ckptr.load_pytree(None, abstract())["step"] == 100
        assert ckptr.last_restore_stats.tier == "persistent"


def test_an_unfinished_local_copy_is_never_restored(tmp_path) -> None:
    with checkpointer(tmp_path) as ckptr:
        run(ckptr, range(0, 121))
    # A save killed before its manifest (the copy's commit) was written.
    os.remove(tmp_path / "local" / "120" / "p0-of-1.manifest.json")
    with checkpointer(tmp_path) as ckptr:
        assert [s.step for s in ckptr.steps(tier="local")] == [110]
        assert ckptr.load_pytree()["step"] == 110


def test_every_checkpointable_round_trips_through_the_local_tier(tmp_path) -> None:
    grain = pytest.importorskip("grain")
    dataset = grain.MapDataset.range(30).shuffle(seed=3).to_iter_dataset()
    iterator = iter(dataset)
    with checkpointer(tmp_path, persistent=1000) as ckptr:
        for step in range(11):
            next(iterator)
            ckptr.save_checkpointables(
                step,
                {"state": state(step), "config": {"lr": 0.1, "name": "run"}, "dataset": iterator},
            )
    expected = [next(iterator) for _ in range(5)]
    resumed = iter(dataset)
    with checkpointer(tmp_path, persistent=1000) as ckptr:
        restored = ckptr.load_checkpointables(
            None, {"state": abstract(), "config": None, "dataset": resumed}
        )
        assert ckptr.last_restore_stats.tier == "local"
    assert restored["state"]["step"] == 10
    assert restored["config"] == {"lr": 0.1, "name": "run"}
    assert [next(resumed) for _ in range(5)] == expected


def test_nothing_restorable_names_both_tiers(tmp_path) -> None:
    with checkpointer(tmp_path) as ckptr:
        with pytest.raises(cp.training.errors.StepNotFoundError, match="on any tier"):
            ckptr.load_pytree()
        assert ckptr.last_restore_stats is None


def test_bad_arguments_are_named(tmp_path) -> None:
    with pytest.raises(cp.errors.InvalidArgumentError, match="keep"):
        cp.training.LocalTier(tmp_path, keep=0)
    with pytest.raises(cp.errors.InvalidArgumentError, match="replicas"):
        cp.training.LocalTier(tmp_path, replicas=-1)
    for seconds in (-1, 0, "10", True, float("nan")):
        with pytest.raises(cp.errors.InvalidArgumentError, match="timeout_secs"):
            cp.training.LocalTier(tmp_path, timeout_secs=seconds)
    with pytest.raises(cp.errors.UnsupportedPathError, match="own disk"):
        cp.training.LocalTier("s3://bucket/x")
    for count in ("2", 2.0):  # A wrong type: both errors, as every option's.
        with pytest.raises(cp.errors.InvalidArgumentTypeError, match="replicas"):
            cp.training.LocalTier(tmp_path, replicas=count)
    assert cp.training.LocalTier(tmp_path, keep=np.int64(3)).keep == 3
    every_10 = cp.training.save_decision_policies.EveryNStepsPolicy
    with pytest.raises(cp.errors.InvalidArgumentTypeError, match=r"instance: EveryNStepsPolicy\("):
        cp.training.LocalTier(tmp_path, save_decision_policy=every_10)
    with pytest.raises(cp.errors.InvalidArgumentTypeError, match="LocalTier"):
        cp.training.Checkpointer(tmp_path / "p", local_tier=str(tmp_path))
    with (
        checkpointer(tmp_path) as ckptr,
        pytest.raises(cp.errors.InvalidArgumentError, match="tier"),
    ):
        ckptr.steps(tier="remote")


def test_without_a_local_tier_restore_stats_count_the_persistent_bytes(tmp_path) -> None:
    with cp.training.Checkpointer(tmp_path) as ckptr:
        ckptr.save_pytree(3, state(3))
        assert ckptr.steps(tier="local") == []
        ckptr.load_pytree()
        stats = ckptr.last_restore_stats
    assert (stats.step, stats.tier, stats.bytes_from_local) == (3, "persistent", 0)
    assert stats.bytes_from_persistent > 0


def test_what_killed_saves_left_does_not_count_against_keep(tmp_path) -> None:
    with checkpointer(tmp_path) as ckptr:
        run(ckptr, range(0, 121))
    # A later incarnation was killed while saving step 130: a copy without its manifest.
    (tmp_path / "local" / "130" / "p0-of-1").mkdir(parents=True)
    with checkpointer(tmp_path) as ckptr:
        assert ckptr.load_pytree()["step"] == 120
        run(ckptr, range(121, 125))  # The resumed run saves nothing locally yet...
        ckptr.save_pytree(125, state(125), force=True)  # ...until a forced save.
        assert [s.step for s in ckptr.steps(tier="local")] == [120, 125]
    assert sorted(os.listdir(tmp_path / "local")) == [OWNER_FILE, LOCK_FILE, "120", "125"]


def test_metadata_of_a_step_only_the_local_tier_holds_reads_this_hosts_copy(tmp_path) -> None:
    with checkpointer(tmp_path, persistent=100, local=5) as ckptr:
        for step in range(12):
            ckptr.save_pytree(step, state(step), metrics={"loss": 1.0 / (step + 1)})
        latest = ckptr.latest_step()
        assert latest.step == 10 and [s.step for s in ckptr.steps(tier="persistent")] == [0]
        meta = ckptr.metadata(latest.step)  # The idiom: the abstract tree of the latest step.
        assert meta.path == tmp_path / "local" / "10" / "p0-of-1"
        assert meta.metrics == {"loss": 1.0 / 11}
        assert meta.metadata["w"].shape == (3, 4) and meta.metadata["b"].dtype == np.int32
        assert ckptr.load_pytree(latest.step, meta.metadata)["step"] == 10
        assert set(ckptr.checkpointables_metadata(5).metadata) == {"state"}
        assert ckptr.metadata(0).path == tmp_path / "persistent" / "0"  # Persistent: as before.
        with pytest.raises(
            cp.training.errors.StepNotFoundError,
            match=r"(?s)step 7 in .*local tier .* has no copy of it on this host "
            r"\(local steps here: 5, 10\)",
        ):
            ckptr.metadata(7)
