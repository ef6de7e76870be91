"""A Checkpointer applies its preservation policy when it opens a root.

A run killed between a commit and the retention pass that follows it leaves
one step more than its policy keeps; a root may also have been written under
another policy. The steps the policy drops leave the listing at once (their
files are removed in the background), except steps being read.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import checkpointables as cp
import pytest

from .helpers import TIMEOUT, Value

D = cp.training.save_decision_policies
P = cp.training.preservation_policies
EVERY_STEP = D.EveryNStepsPolicy(1)


def step_dirs(root) -> list[int]:
    return sorted(int(n) for n in os.listdir(root) if n.isdigit())


_KILLED_AFTER_A_COMMIT = textwrap.dedent(
    """
    import sys, time
    import checkpointables as cp

    P = cp.training.preservation_policies

    class StallsAfterTheFourthCommit:
        # LatestN(3), but the retention pass that would delete a step never ends: the
        # parent kills the process there, right after the fourth step committed.
        def should_preserve(self, steps, *, context):
            if len(steps) > 3:
                print("deciding", flush=True)
                time.sleep(600)
            return P.LatestN(3).should_preserve(steps, context=context)

    ckptr = cp.training.Checkpointer(
        sys.argv[1],
        save_decision_policy=cp.training.save_decision_policies.EveryNStepsPolicy(1),
        preservation_policy=StallsAfterTheFourthCommit(),
    )
    for step in range(4):
        ckptr.save_checkpointables(step, {"extra": {"step": step}}, metrics={"loss": 1.0})
    time.sleep(600)
    """
)


def test_a_kill_between_a_commit_and_its_retention_is_repaired_on_reopening(tmp_path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_AFTER_A_COMMIT, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "deciding\n", "the child did not reach its retention"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(TIMEOUT) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert step_dirs(tmp_path) == [0, 1, 2, 3]  # What the kill left.
    with cp.training.Checkpointer(tmp_path, preservation_policy=P.LatestN(3)) as ckptr:
        assert [s.step for s in ckptr.steps()] == [1, 2, 3]  # At once, before any save.
        for step in (1, 2, 3):
            assert ckptr.load_checkpointables(step) == {"extra": {"step": step}}
        with pytest.raises(cp.training.errors.StepNotFoundError):
            ckptr.load_checkpointables(0)
    assert step_dirs(tmp_path) == [1, 2, 3]


LOSSES = [0.9, 0.1, 0.8, 0.2, 0.7, 0.6]


@pytest.mark.parametrize(
    ("policy", "kept"),
    [
        (P.PreserveAll(), [0, 1, 2, 3, 4, 5]),
        (P.LatestN(3), [3, 4, 5]),
        (P.LatestN(1), [5]),
        (P.EveryNSteps(2), [0, 2, 4, 5]),  # The latest step is always kept.
        (P.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=2), [1, 3, 5]),
        (P.AnyPreservationPolicy([P.LatestN(2), P.EveryNSteps(3)]), [0, 3, 4, 5]),
    ],
)
def test_a_root_written_under_another_policy_is_trimmed_on_opening(tmp_path, policy, kept):
    with cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP) as writer:
        for step, loss in enumerate(LOSSES):
            writer.save_checkpointables(step, {"extra": {"step": step}}, metrics={"loss": loss})
    ckptr = cp.training.Checkpointer(tmp_path, preservation_policy=policy)
    assert [s.step for s in ckptr.steps()] == kept
    ckptr.close()
    assert step_dirs(tmp_path) == kept
    assert [s.step for s in cp.training.Checkpointer(tmp_path).steps()] == kept


def test_opening_spares_a_step_another_checkpointer_is_reading(tmp_path) -> None:
    reader = cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP)
    for step in range(3):
        reader.save_checkpointables(step, {"v": Value(step)})
    gate = threading.Event()
    value = Value(load_gate=gate)
    loading = reader.load_checkpointables_async(0, {"v": value})
    assert value.reading.wait(TIMEOUT)
    trimmed = cp.training.Checkpointer(
        tmp_path, save_decision_policy=EVERY_STEP, preservation_policy=P.LatestN(1)
    )
    trimmed.wait()
    assert step_dirs(tmp_path) == [0, 2]  # Step 0 is being read: it stays for now.
    gate.set()
    assert loading.result()["v"].value == 0
    trimmed.save_checkpointables(3, {"v": Value(3)})
    trimmed.close()
    assert step_dirs(tmp_path) == [3]
    reader.close()


def test_a_policy_failing_on_opening_deletes_nothing_and_surfaces_later(tmp_path) -> None:
    class Broken:
        def should_preserve(self, steps, *, context):
            return [True]  # Wrong length.

    with cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP) as writer:
        for step in range(3):
            writer.save_checkpointables(step, {"extra": {"step": step}})
    ckptr = cp.training.Checkpointer(tmp_path, preservation_policy=Broken())
    assert [s.step for s in ckptr.steps()] == [0, 1, 2]
    assert ckptr.load_checkpointables(2) == {"extra": {"step": 2}}
    with pytest.raises(ValueError, match="returned 1 decisions for 3 steps"):
        ckptr.wait()
    ckptr.close()
    assert step_dirs(tmp_path) == [0, 1, 2]
