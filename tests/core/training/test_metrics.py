"""A step's metrics are stored as JSON by ``cp.safe_json.to_json_value``, as custom metadata
is: NumPy and JAX scalars become Python numbers, and what JSON cannot store is refused at
save time, naming the metric, before anything is written."""

from __future__ import annotations

import json
import math
import os

import checkpointables as cp
import jax.numpy as jnp
import numpy as np
import pytest

EVERY_STEP = cp.training.save_decision_policies.EveryNStepsPolicy(1)


def _checkpointer(path) -> cp.training.Checkpointer:
    return cp.training.Checkpointer(path, save_decision_policy=EVERY_STEP)


def test_numpy_and_jax_scalars_are_stored_as_python_numbers(tmp_path) -> None:
    metrics = {
        "loss": jnp.float32(0.25),
        "batch_loss": jnp.ones(1) * 0.5,  # A (1,) array: one number.
        "step": np.int64(3),
        "tokens": jnp.int32(7),
        "ok": jnp.bool_(True),
        "diverged": np.float32("nan"),  # Kept: a diverged loss is worth recording.
        "eval": {"acc": np.float64(0.75), "per_task": (np.float16(1.5), 2)},
        "note": None,
    }
    with _checkpointer(tmp_path) as ckptr:
        ckptr.save_checkpointables(0, {"extra": {}}, metrics=metrics)
        read = ckptr.latest_step().metrics
    stored = json.loads((tmp_path / "0" / "_CHECKPOINT_METADATA").read_text())["metrics"]
    for found in (stored, read):
        assert math.isnan(found.pop("diverged"))
        assert found == {
            "loss": 0.25,
            "batch_loss": 0.5,
            "step": 3,
            "tokens": 7,
            "ok": True,
            "eval": {"acc": 0.75, "per_task": [1.5, 2]},
            "note": None,
        }
    assert [type(read[k]) for k in ("loss", "batch_loss", "step", "tokens", "ok")] == [
        float,
        float,
        int,
        int,
        bool,
    ]


@pytest.mark.parametrize(
    ("metrics", "named"),
    [
        ({"acc": np.zeros(3)}, "metrics['acc'] is a ndarray of shape (3,)"),
        ({"eval": {"acc": jnp.ones((2, 2))}}, "metrics['eval']['acc'] is an ArrayImpl of shape"),
        ({"eval": [1.0, {2, 3}]}, "metrics['eval'][1] is a set"),
        ({"lr": object()}, "metrics['lr'] is an object"),
        ({"eval": {1: 0.5}}, "metrics['eval'] has the key 1 (int); its keys must be strings"),
        ({None: 0.5}, "metrics has the key None (NoneType); its keys must be strings"),
    ],
)
def test_a_metric_json_cannot_store_is_named_before_anything_is_written(
    tmp_path, metrics, named
) -> None:
    with _checkpointer(tmp_path) as ckptr:
        with pytest.raises(cp.errors.InvalidArgumentError) as info:
            ckptr.save_checkpointables(0, {"extra": {}}, metrics=metrics)
        assert named in str(info.value)
        assert ckptr.latest_step() is None
    assert os.listdir(tmp_path) == []


def test_metrics_that_refer_to_themselves_are_refused_clearly(tmp_path) -> None:
    # A RecursionError from deep inside the conversion used to escape the save.
    metrics: dict = {"loss": 0.5}
    metrics["self"] = metrics
    with _checkpointer(tmp_path) as ckptr:
        with pytest.raises(cp.errors.InvalidArgumentError, match="metrics is nested too deeply"):
            ckptr.save_checkpointables(0, {"extra": {}}, metrics=metrics)
        with pytest.raises(cp.errors.InvalidArgumentError, match="must be a dict"):
            ckptr.save_checkpointables(0, {"extra": {}}, metrics=[0.5])  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []
