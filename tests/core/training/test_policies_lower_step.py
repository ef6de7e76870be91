"""A step saved below the latest that the preservation policy drops at once: the save
returns True (it did commit), and a warning names the step and the policy."""

from __future__ import annotations

import logging
from pathlib import Path

import checkpointables as cp
import numpy as np
import pytest

P = cp.training.preservation_policies
LOGGER = "checkpointables.training._retention"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_lower_step_dropped_at_once_is_warned_about(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with cp.training.Checkpointer(tmp_path, preservation_policy=P.LatestN(2)) as ckptr:
        for step in (10, 20):
            assert ckptr.save_pytree(step, {"w": np.ones(2)}, force=True)
        ckptr.wait()
        assert _warnings(caplog) == []
        assert ckptr.save_pytree(5, {"w": np.ones(2)}, force=True)
        ckptr.wait()
        assert [s.step for s in ckptr.steps()] == [10, 20]
    (said,) = _warnings(caplog)
    assert "Step 5 " in said and "below the latest step 20" in said
    assert "LatestN(n=2)" in said and "save it under a step above 20" in said


def test_steps_dropped_in_order_or_at_start_are_not_warned_about(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with cp.training.Checkpointer(tmp_path) as ckptr:
        for step in (1, 2, 3):
            ckptr.save_pytree(step, {"w": np.ones(2)}, force=True)
    # Reopened under a stricter policy: the old steps it drops were not just saved.
    with cp.training.Checkpointer(tmp_path, preservation_policy=P.LatestN(1)) as ckptr:
        ckptr.save_pytree(4, {"w": np.ones(2)}, force=True)
        ckptr.save_pytree(5, {"w": np.ones(2)}, force=True)
        ckptr.wait()
        assert [s.step for s in ckptr.steps()] == [5]
    assert _warnings(caplog) == []


def test_a_lower_step_the_policy_keeps_is_not_warned_about(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    keep = P.AnyPreservationPolicy([P.LatestN(1), P.EveryNSteps(5)])
    with cp.training.Checkpointer(tmp_path, preservation_policy=keep) as ckptr:
        ckptr.save_pytree(12, {"w": np.ones(2)}, force=True)
        ckptr.save_pytree(5, {"w": np.ones(2)}, force=True)
        ckptr.wait()
        assert [s.step for s in ckptr.steps()] == [5, 12]
    assert _warnings(caplog) == []
