"""The local tier in front of an S3 persistent tier (moto): restores read local disks and
nothing from the bucket, and the bucket when the local copies are gone or damaged."""

from __future__ import annotations

import shutil

import checkpointables as cp
import numpy as np

from .helpers import keys

EveryN = cp.training.save_decision_policies.EveryNStepsPolicy


def state(step: int) -> dict:
    return {"w": np.full((64, 64), step, np.float32), "step": step}


def checkpointer(root: str, local) -> cp.training.Checkpointer:
    tier = cp.training.LocalTier(local, save_decision_policy=EveryN(5), keep=2)
    return cp.training.Checkpointer(root, save_decision_policy=EveryN(10), local_tier=tier)


def test_local_steps_restore_without_the_bucket_and_the_bucket_without_them(
    s3, bucket, tmp_path
) -> None:
    root, local = f"{bucket}/run", tmp_path / "local"
    with checkpointer(root, local) as ckptr:
        for step in range(27):
            ckptr.save_pytree(step, state(step))
        assert [s.step for s in ckptr.steps(tier="persistent")] == [0, 10, 20]
        assert [s.step for s in ckptr.steps(tier="local")] == [20, 25]
    # The persistent tier is an ordinary run in the bucket.
    assert sorted({k.split("/")[0] for k in keys(s3, root)}) == ["0", "10", "20"]

    with checkpointer(root, local) as ckptr:
        assert ckptr.load_pytree()["step"] == 25
        stats = ckptr.last_restore_stats
    assert (stats.tier, stats.bytes_from_persistent) == ("local", 0)

    shutil.rmtree(local)
    with checkpointer(root, local) as ckptr:
        restored = ckptr.load_pytree()
        stats = ckptr.last_restore_stats
    np.testing.assert_array_equal(restored["w"], state(20)["w"])
    assert (stats.step, stats.tier, stats.bytes_from_local) == (20, "persistent", 0)
    assert stats.bytes_from_persistent == 64 * 64 * 4
