"""A training process killed with SIGKILL at random moments leaves only loadable steps.

A real subprocess (``crash_child.py``) trains, saves every step
asynchronously, overwrites steps and garbage-collects old ones; the test
kills it at a random moment, many times over the same root. After each kill
a new Checkpointer must list only steps that load bit for bit, never lose a
step the child saw committed, and remove every temporary directory the dead
child left.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import checkpointables as cp
import numpy as np
import pytest

from . import crash_child

CHILD = Path(crash_child.__file__)


def pytree_plugin_installed() -> bool:
    try:
        cp.handlers.get("pytree")
    except cp.errors.CheckpointError:
        return False
    return True


def run_and_kill(root: Path, mode: str, delay: float) -> int | None:
    """Runs the child until ``delay`` s after it is ready, kills it; returns its last commit."""
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(root), mode], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n", "the training process failed to start"
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        output = proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL, f"the child ended by itself: {proc.returncode}"
    committed = [
        int(line.split()[1]) for line in output.splitlines() if line.startswith("committed")
    ]
    return max(committed) if committed else None


def check_step(ckptr: cp.training.Checkpointer, info: cp.training.StepInfo, mode: str) -> None:
    step = info.step
    abstract = {"blob": crash_child.Blob(), "meta": None}
    if mode == "pytree":
        abstract["pytree"] = None
    loaded = ckptr.load_checkpointables(step, abstract)
    assert loaded["blob"].parts == [
        crash_child.blob_part(step, i) for i in range(crash_child.FILES)
    ]
    assert loaded["meta"] == {"step": step}
    assert info.metrics == crash_child.metrics(step)
    if mode == "pytree":
        expected = crash_child.tree(step)
        for key, value in expected.items():
            got = np.asarray(loaded["pytree"][key])
            assert got.dtype == value.dtype and np.array_equal(got, value), (step, key)


def temporaries(root: Path) -> list[str]:
    if not root.exists():  # Killed before its first save began.
        return []
    return [n for n in os.listdir(root) if cp.layout.is_temporary_path(root / n)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "kills", "budget_secs"),
    [("json", 30, 16.0), ("pytree", 10, 20.0)],
)
def test_sigkill_at_random_moments(tmp_path, mode, kills, budget_secs) -> None:
    if mode == "pytree" and not pytree_plugin_installed():
        pytest.skip("needs the pytree plugin (checkpointables-pytree)")
    rng = random.Random(f"crash-{mode}")
    root = tmp_path / "run"
    done = interrupted = 0
    last_committed: int | None = None
    deadline = time.monotonic() + budget_secs
    # At least a few kills even on a slow machine; at most `kills`, within the budget.
    while done < kills and (done < 5 or time.monotonic() < deadline):
        committed = run_and_kill(root, mode, rng.uniform(0.0, 0.4))
        done += 1
        if committed is not None:
            last_committed = committed
        left = temporaries(root)
        interrupted += bool(left)
        ckptr = cp.training.Checkpointer(root)
        steps = ckptr.steps()
        if last_committed is not None:
            # A step the dead process saw committed is still there (or a later one).
            assert steps and steps[-1].step >= last_committed, (left, steps, last_committed)
        for info in steps:
            check_step(ckptr, info, mode)
        ckptr.close()  # Waits for the cleanup of what the dead process left.
        assert temporaries(root) == [], f"after kill {done}: {os.listdir(root)}"
    # The kills did land mid-operation (not only between saves).
    assert interrupted >= 1, f"no kill interrupted a save or deletion in {done} tries"
    assert last_committed is not None and last_committed > 0
