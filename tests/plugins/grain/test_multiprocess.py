"""Grain iterators in a real two-process jax.distributed job: one state file per process."""

from __future__ import annotations

import json

import checkpointables as cp
import grain
import pytest
from checkpointables_grain import ProcessCountMismatchError

from ...integration.multiprocess.launcher import run_job

pytestmark = pytest.mark.multiprocess

BODY = """
import grain
import numpy as np

def pipeline():
    # Each process reads its own shard, as in data-parallel training.
    return grain.MapDataset.range(40)[PROCESS_ID::NUM_PROCESSES].shuffle(seed=1).to_iter_dataset()

def take(it, n):
    return [int(next(it)) for _ in range(n)]

path = sys.argv[1]
it = iter(pipeline())
take(it, 3 + PROCESS_ID)  # The processes stand at different positions.
cp.save_checkpointables(path, {"train_state": {"step": 7}, "dataset": it})
expected = take(it, 5)
fresh = iter(pipeline())
loaded = cp.load_checkpointables(path, {"train_state": None, "dataset": fresh})
assert loaded["dataset"] is fresh
got = take(fresh, 5)
assert got == expected, (got, expected)
print("RESUMED", PROCESS_ID, got)
"""


def test_each_process_saves_and_restores_its_own_state(tmp_path) -> None:
    path = tmp_path / "ckpt"
    for result in run_job(BODY, args=[str(path)]):
        result.check()
        assert f"RESUMED {result.process_id}" in result.stdout
    directory = path / "dataset"
    states = [json.loads((directory / f"process_{i}-of-2.json").read_text()) for i in range(2)]
    assert [s["next_index"] for s in states] == [3, 4]
    assert json.loads((directory / "grain_iterator.json").read_text())["process_count"] == 2
    assert cp.checkpointables_metadata(path).metadata["dataset"].process_count == 2
    # This test process is a job of one: the states of two processes do not fit it.
    fresh = iter(grain.MapDataset.range(40).to_iter_dataset())
    with pytest.raises(ProcessCountMismatchError, match="states of 2 process.*this job has 1"):
        cp.load_checkpointables(path, {"dataset": fresh})
