"""Per-save statistics of the Checkpointer: bytes written, time blocked, time to commit."""

from __future__ import annotations

import logging

import checkpointables as cp
import jax
import numpy as np

EVERY_STEP = cp.training.save_decision_policies.EveryNStepsPolicy(1)


def test_each_committed_save_reports_its_cost(tmp_path, caplog) -> None:
    state = {"w": jax.numpy.ones((256, 256)), "b": np.zeros(100, np.float64), "step": 3}
    expected_bytes = 256 * 256 * 4 + 100 * 8
    caplog.set_level(logging.INFO, logger="checkpointables.training")
    # Every byte written at each step: reuse (the default on local disks) would link step 2's.
    with cp.training.Checkpointer(
        tmp_path, save_decision_policy=EVERY_STEP, reuse_unchanged=False
    ) as ckptr:
        assert ckptr.last_save_stats is None
        ckptr.save_pytree(1, state)
        first = ckptr.last_save_stats
        assert first.step == 1 and first.bytes_written == expected_bytes
        assert 0 < first.blocked_secs <= first.commit_secs
        assert ckptr.save_pytree_async(2, state).result()
        second = ckptr.last_save_stats
        assert second.step == 2 and second.bytes_written == expected_bytes
    assert ckptr.last_save_stats.step == 2
    assert set(second.as_dict()) == {
        "checkpoint/bytes_written",
        "checkpoint/bytes_reused",
        "checkpoint/peak_staging_bytes",
        "checkpoint/blocked_secs",
        "checkpoint/commit_secs",
    }
    logged = [r.getMessage() for r in caplog.records if r.name == "checkpointables.training"]
    expected = "Saved step 1: 0.3 MiB written, 0.0 MiB reused, 0.0 MiB staged at most, blocked "
    assert any(m.startswith(expected) for m in logged), logged
    assert any(m.startswith("Saved step 2: ") and "committed after" in m for m in logged)


def test_failed_saves_record_no_stats(tmp_path) -> None:
    class Broken:
        async def save(self, directory):
            async def write():
                raise OSError("disk full")

            return write()

        async def load(self, directory):
            async def read():
                return None

            return read()

    with cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP) as ckptr:
        response = ckptr.save_checkpointables_async(1, {"x": Broken()})
        assert response.exception() is not None
        assert ckptr.last_save_stats is None
