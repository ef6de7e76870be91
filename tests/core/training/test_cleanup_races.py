"""A save of a step never races the removal of what is there by its own Checkpointer's
worker (``_retention.Removals``): a queued removal is dropped, a running one waited for.

On a local disk the worker removes only temporary names, which no save writes again: a
save of a step whose killed save (or interrupted deletion) is being cleaned up is safe
there without waiting (the object-store races: tests/integration/object_store/
test_cleanup_races.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import checkpointables as cp
import numpy as np
import pytest
from checkpointables import layout
from checkpointables.training._retention import Removals
from etils import epath


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_claim_drops_a_queued_removal() -> None:
    removals, path = Removals(), epath.Path("s3://b/run/5")
    removals.queue([path, epath.Path("s3://b/run/10")])
    removals.claim(path, timeout=1)
    assert not removals.begin(path)  # The removal skips it: the save replaces it.
    assert removals.begin(epath.Path("s3://b/run/10"))


def test_a_claim_waits_for_a_running_removal() -> None:
    removals, path = Removals(), epath.Path("s3://b/run/5")
    removals.queue([path])
    assert removals.begin(path)
    claimed = threading.Event()
    waiting = threading.Thread(target=lambda: (removals.claim(path, 30), claimed.set()))
    waiting.start()
    assert not claimed.wait(0.1)
    removals.end(path)
    assert claimed.wait(30)
    waiting.join()
    assert not removals.begin(path)  # Done: nothing queued any more.


def test_a_claim_gives_up_after_the_timeout_saying_what_to_do() -> None:
    removals, path = Removals(), epath.Path("s3://b/run/5")
    removals.queue([path])
    assert removals.begin(path)
    with pytest.raises(TimeoutError, match=r"s3://b/run/5 is still running after 0.05 s"):
        removals.claim(path, 0.05)
    removals.end(path)


def _leftover(final: epath.Path, infix: str, pid: int) -> epath.Path:
    """What a killed process left for ``final``: a temporary entry named as its saves (or
    deletions) name them, holding files."""
    fresh = layout.temporary_path_for(final, infix)
    name = fresh.name.replace(f"-{os.getpid()}-", f"-{pid}-")
    entry = final.parent / name
    (entry / "state").mkdir(parents=True)
    (entry / "state" / "half").write_text("half a save")
    return entry


def test_on_a_local_disk_a_step_saved_again_at_once_is_not_touched(tmp_path) -> None:
    root = epath.Path(tmp_path)
    with cp.training.Checkpointer(root) as checkpointer:
        checkpointer.save_pytree(1, {"w": np.arange(3)})
    killed = _leftover(root / "5", layout.TMP_INFIX, _dead_pid())
    deleting = _leftover(root / "5", layout.OLD_INFIX, _dead_pid())
    started = time.time_ns()
    with cp.training.Checkpointer(root) as checkpointer:
        assert checkpointer.save_pytree(5, {"w": np.arange(4)})  # The cleanup runs meanwhile.
    assert not killed.exists() and not deleting.exists()
    assert sorted(os.listdir(root)) == ["1", "5"]
    assert os.stat(root / "5").st_mtime_ns >= started
    loaded = cp.training.Checkpointer(root).load_pytree(5)
    assert np.array_equal(loaded["w"], np.arange(4))
