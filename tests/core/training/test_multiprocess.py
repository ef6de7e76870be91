"""The Checkpointer in a real two-process jax.distributed job."""

from __future__ import annotations

import os

import checkpointables as cp
import pytest

from ...integration.multiprocess.launcher import run_job

pytestmark = pytest.mark.multiprocess


def test_processes_follow_the_primary_decision_and_agree_on_steps(tmp_path) -> None:
    body = """
    class Disagreeing:
        # Process 0 wants even steps, process 1 odd ones: left alone, they
        # would wait for each other forever. The primary's decision wins.
        def should_save(self, step, previous_steps, *, context):
            return step.step % 2 == PROCESS_ID

    keep = cp.training.preservation_policies.LatestN(2)
    with cp.training.Checkpointer(
        sys.argv[1], save_decision_policy=Disagreeing(), preservation_policy=keep,
        custom_metadata={"job": "two"},
    ) as ckptr:
        saved = [s for s in range(7) if ckptr.save_checkpointables(s, {"extra": {"s": s}})]
        ckptr.wait()
        print("SAVED", saved)
        print("STEPS", [s.step for s in ckptr.steps()])
        print("LATEST", ckptr.load_checkpointables())
    """
    results = [r.check() for r in run_job(body, args=[str(tmp_path / "root")])]
    for r in results:
        assert "SAVED [0, 2, 4, 6]" in r.stdout
        assert "STEPS [4, 6]" in r.stdout
        assert "LATEST {'extra': {'s': 6}}" in r.stdout
    assert sorted(os.listdir(tmp_path / "root")) == ["4", "6", "metadata"]
    assert cp.training.Checkpointer(tmp_path / "root").metadata().custom_metadata == {"job": "two"}
