"""Training loops killed with SIGKILL while saving to S3: no committed partial checkpoint, ever.

Four workers, each with its own root, save step after step through a
Checkpointer (keeping the latest 3, so deletions get killed too) and are
killed at random moments, then restarted; each restart resumes from the
latest committed step and checks it. Afterwards every committed step in
the bucket loads bit for bit, and what the kills left is cleaned up.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import checkpointables as cp
import numpy as np
import pytest

from .helpers import assert_equal, keys

pytestmark = pytest.mark.slow

KILLS_PER_WORKER = 3
WORKERS = 4


def state(step: int) -> dict:
    """The training state of ``step`` (the same in the workers and here)."""
    rng = np.random.default_rng(step)
    return {
        "w": rng.random(1 << 17),  # 1 MiB
        "small": {f"leaf{i}": rng.random(8) for i in range(50)},
        "step": step,
    }


_WORKER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import checkpointables as cp

    def state(step):
        rng = np.random.default_rng(step)
        return {"w": rng.random(1 << 17), "small": {f"leaf{i}": rng.random(8) for i in range(50)},
                "step": step}

    keep = cp.training.preservation_policies.LatestN(3)
    with cp.training.Checkpointer(sys.argv[1], preservation_policy=keep) as checkpointer:
        latest = checkpointer.latest_step()
        step = 0
        if latest is not None:
            restored = checkpointer.load_pytree()
            assert restored["step"] == latest.step
            np.testing.assert_array_equal(restored["w"], state(latest.step)["w"])
            step = latest.step + 1
        print("READY", step, flush=True)
        while True:
            checkpointer.save_pytree(step, state(step), force=True)
            print("SAVED", step, flush=True)
            step += 1
    """
)


def _kill_repeatedly(root: str, seed: int, log: list[str]) -> None:
    rng = random.Random(seed)
    for run in range(KILLS_PER_WORKER):
        with subprocess.Popen(
            [sys.executable, "-c", _WORKER, root],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as process:
            try:
                line = process.stdout.readline()  # Bounded: the worker prints READY or dies.
                assert line.startswith("READY"), line + process.stderr.read()[-3000:]
                if run == 0:  # Something committed, to resume from and check later.
                    line += process.stdout.readline()
                time.sleep(rng.uniform(0.05, 0.8))  # Mostly mid-save: the loop does little else.
                process.send_signal(signal.SIGKILL)
            finally:
                process.wait(60)
            log.append(line + process.stdout.read())


def test_sigkill_while_saving_never_commits_a_partial_checkpoint(s3) -> None:
    bucket = f"s3://{s3.new_bucket()}"
    roots = [f"{bucket}/worker{i}" for i in range(WORKERS)]
    logs: list[list[str]] = [[] for _ in roots]
    threads = [
        threading.Thread(target=_kill_repeatedly, args=(root, i, logs[i]))
        for i, root in enumerate(roots)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert sum(len(log) for log in logs) == WORKERS * KILLS_PER_WORKER >= 10

    for root in roots:
        committed = {k.split("/")[0] for k in keys(s3, root) if k.endswith("/commit_success.txt")}
        assert committed, f"nothing committed under {root}"
        for name in committed:  # Every committed step, listed by the Checkpointer or not.
            assert_equal(cp.load_pytree(f"{root}/{name}"), state(int(name)))
        with cp.training.Checkpointer(root) as checkpointer:
            assert {str(s.step) for s in checkpointer.steps()} == committed
            checkpointer.wait()  # Its cleanup of what the kills left.
        left = {k.split("/")[0] for k in keys(s3, root)} - committed - {"metadata"}
        assert not left, f"unfinished saves or deletions not cleaned under {root}: {left}"
    assert os.environ["AWS_ENDPOINT_URL"] == s3.endpoint  # The workers went to the test server.
