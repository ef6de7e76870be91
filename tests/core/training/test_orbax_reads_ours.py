"""Steps our Checkpointer writes load with Orbax's V1 training Checkpointer (orbax 0.12.8).

Orbax is used as its users call it (``orbax_reader.py``, in its own process):
``load(step)`` reads the checkpointable ``state``, ``load_checkpointables(step)``
everything but the reserved ``metrics`` item, and the metrics of its listed
steps come from ``<step>/metrics/metrics``. Our Checkpointer keeps loading
the steps it wrote before it named its pytree ``state``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import checkpointables as cp
import numpy as np
import pytest

from . import orbax_reader

D = cp.training.save_decision_policies

# Metrics of several shapes, as training code passes them; index = step.
METRICS: list[dict[str, Any] | None] = [
    {"loss": 0.5},
    {"loss": 0.25, "acc": {"top1": 0.875, "top5": 0.96875}},
    {"loss": 2, "lr": 1e-3, "tags": ["warmup", "bf16"], "diverged": False, "note": None},
    {"loss": np.float32(0.125), "tokens": np.int64(1 << 40), "grad_norm": np.array(3.5)},
    None,  # A step saved without metrics.
]
# What a JSON reader sees of them (scalar NumPy values become numbers).
STORED: list[dict[str, Any] | None] = [
    *METRICS[:3],
    {"loss": 0.125, "tokens": 1 << 40, "grad_norm": 3.5},
    None,
]


def tree(step: int) -> dict[str, Any]:
    w = np.arange(6, dtype=np.float32).reshape(2, 3) * step
    return {"w": w, "n": np.array([step], dtype=np.int32)}


def read_with_orbax(root: Path) -> dict[str, Any]:
    pytest.importorskip("orbax.checkpoint")
    done = subprocess.run(
        [sys.executable, orbax_reader.__file__, str(root)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def ok(result: dict[str, Any]) -> Any:
    assert "error" not in result, result["error"]
    return result["ok"]


def needs_pytree() -> None:
    try:
        cp.handlers.get("pytree")
    except cp.errors.CheckpointError:
        pytest.skip("needs the pytree plugin (checkpointables-pytree)")


def checkpointer(root: Path) -> cp.training.Checkpointer:
    return cp.training.Checkpointer(
        root, save_decision_policy=D.EveryNStepsPolicy(1), custom_metadata={"run": "ours"}
    )


def test_orbax_loads_our_save_pytree_steps_with_their_metrics(tmp_path) -> None:
    needs_pytree()
    from checkpointables import cli

    with checkpointer(tmp_path) as ckptr:
        for step, metrics in enumerate(METRICS):
            assert ckptr.save_pytree(step, tree(step), metrics=metrics)
    report = read_with_orbax(tmp_path)
    assert report["steps"] == [[step, stored] for step, stored in enumerate(STORED)]
    assert report["root_metadata"] == {"run": "ours"}
    for step, stored in enumerate(STORED):
        seen = report["by_step"][str(step)]
        loaded = ok(seen["load"])
        assert loaded["w"] == {"dtype": "float32", "values": tree(step)["w"].tolist()}
        assert loaded["n"] == {"dtype": "int32", "values": [step]}
        assert ok(seen["metadata_metrics"]) == stored
        assert ok(seen["checkpointables_metadata"]) == ["state"]
        assert cli.main(["verify", str(tmp_path / str(step))]) == 0
    # And ours reads them back, metrics included.
    again = cp.training.Checkpointer(tmp_path)
    assert [s.metrics for s in again.steps()] == [m or {} for m in STORED]
    assert np.array_equal(again.load_pytree(3)["w"], tree(3)["w"])
    assert again.metadata(1).metrics == STORED[1]


def test_orbax_loads_our_save_checkpointables_steps(tmp_path) -> None:
    needs_pytree()
    extra = {"x": [1, 2], "s": "hi", "nested": {"ok": True}}
    with checkpointer(tmp_path) as ckptr:
        ckptr.save_checkpointables(0, {"state": tree(0), "extra": extra}, metrics=METRICS[1])
        ckptr.save_checkpointables(1, {"state": tree(1), "extra": extra})
    report = read_with_orbax(tmp_path)
    assert report["steps"] == [[0, STORED[1]], [1, None]]
    for step in (0, 1):
        seen = report["by_step"][str(step)]
        loaded = ok(seen["load_checkpointables"])
        assert set(loaded) == {"state", "extra"}  # Never the metrics item.
        assert loaded["extra"] == extra
        assert loaded["state"]["w"]["values"] == tree(step)["w"].tolist()
        assert ok(seen["load"])["n"]["values"] == [step]
        assert ok(seen["checkpointables_metadata"]) == ["extra", "state"]
    assert ok(report["by_step"]["0"]["metadata_metrics"]) == STORED[1]


def test_steps_written_before_the_state_name_keep_loading(tmp_path) -> None:
    needs_pytree()
    # What the Checkpointer wrote before: the pytree named "pytree" (also the free
    # functions' name), and steps written by cp.save_pytree into the root.
    with checkpointer(tmp_path) as ckptr:
        ckptr.save_pytree(0, tree(0), checkpointable_name="pytree", metrics=METRICS[0])
    cp.save_pytree(tmp_path / "1", tree(1))
    with checkpointer(tmp_path) as ckptr:
        ckptr.save_pytree(2, tree(2), metrics=METRICS[1])
        assert [s.step for s in ckptr.steps()] == [0, 1, 2]
        for step in range(3):
            assert np.array_equal(ckptr.load_pytree(step)["w"], tree(step)["w"])
            assert ckptr.metadata(step).metadata["w"].shape == (2, 3)
        assert set(ckptr.load_checkpointables(0)) == {"pytree"}
        assert set(ckptr.load_checkpointables(2)) == {"state"}
        assert ckptr.steps()[0].metrics == METRICS[0]
    # Orbax loads the new step by its natural call, and the old ones by their name.
    report = read_with_orbax(tmp_path)
    assert ok(report["by_step"]["2"]["load"])["n"]["values"] == [2]
    assert set(ok(report["by_step"]["0"]["load_checkpointables"])) == {"pytree"}
    assert report["steps"][:2] == [[0, METRICS[0]], [1, None]]
