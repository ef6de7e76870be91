"""Roots written by Orbax's training Checkpointer and CheckpointManager (orbax-checkpoint 0.12.8).

Their step directories have ``_CHECKPOINT_METADATA`` but no ``orbax.checkpoint``
marker, keep metrics in ``metrics/metrics`` and root metadata in
``metadata/_ROOT_METADATA``. They must be listed, loadable, and continuable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import checkpointables as cp
import numpy as np
import pytest

from . import orbax_writer

P = cp.training.preservation_policies


@pytest.fixture(scope="module")
def orbax_roots(tmp_path_factory) -> Path:
    pytest.importorskip("orbax.checkpoint")
    directory = tmp_path_factory.mktemp("orbax")
    subprocess.run(
        [sys.executable, orbax_writer.__file__, str(directory)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return directory


def copy_of(root: Path, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / root.name
    shutil.copytree(root, target)
    return target


def needs_pytree() -> None:
    try:
        cp.handlers.get("pytree")
    except cp.errors.CheckpointError:
        pytest.skip("needs the pytree plugin (checkpointables-pytree)")


def test_v1_checkpointer_root_is_listed_with_metrics(orbax_roots) -> None:
    ckptr = cp.training.Checkpointer(orbax_roots / "v1")
    steps = ckptr.steps()
    assert [s.step for s in steps] == [0, 1, 2]
    assert [s.metrics for s in steps] == [{"loss": 1.0}, {"loss": 0.5}, {"loss": 1.0 / 3}]
    assert all(s.commit_timestamp_nsecs for s in steps)
    assert ckptr.metadata().custom_metadata == {"exp": "x"}
    # Metrics drive preservation as for our own steps.
    best = P.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=1)
    decisions = best.should_preserve(steps, context=P.PreservationContext())
    assert list(decisions) == [False, False, True]


def test_v0_manager_root_is_listed_and_its_json_item_loads(orbax_roots) -> None:
    ckptr = cp.training.Checkpointer(orbax_roots / "v0")
    assert [s.step for s in ckptr.steps()] == [0, 10, 20]
    assert ckptr.metadata().custom_metadata == {"hello": 1}
    assert ckptr.load_checkpointables(10, {"extra": None}) == {"extra": {"step": 10, "x": [1, 2]}}
    assert (
        cp.load_checkpointables(orbax_roots / "v0" / "20", {"extra": None})["extra"]["step"] == 20
    )


def test_prefixed_root_needs_the_matching_name_format(orbax_roots) -> None:
    assert cp.training.Checkpointer(orbax_roots / "prefixed").steps() == []
    fmt = cp.training.standard_name_format(step_prefix="step", step_format_fixed_length=5)
    ckptr = cp.training.Checkpointer(orbax_roots / "prefixed", step_name_format=fmt)
    assert [s.step for s in ckptr.steps()] == [5, 15]
    assert ckptr.latest_step().path.name == "step_00015"


def test_an_orbax_root_can_be_continued(orbax_roots, tmp_path) -> None:
    root = copy_of(orbax_roots / "v1", tmp_path)
    (root / "3.orbax-checkpoint-tmp").mkdir()  # An Orbax save that never finished.
    policy = cp.training.save_decision_policies.EveryNStepsPolicy(1)
    with cp.training.Checkpointer(
        root, save_decision_policy=policy, preservation_policy=P.LatestN(2)
    ) as ckptr:
        assert ckptr.latest_step().step == 2
        ckptr.save_checkpointables(3, {"extra": {"resumed": True}}, metrics={"loss": 0.1})
        ckptr.save_checkpointables(4, {"extra": {"resumed": True}}, metrics={"loss": 0.05})
    assert sorted(os.listdir(root)) == ["3", "3.orbax-checkpoint-tmp", "4", "metadata"]
    again = cp.training.Checkpointer(root)
    assert [(s.step, s.metrics) for s in again.steps()] == [(3, {"loss": 0.1}), (4, {"loss": 0.05})]
    assert again.metadata().custom_metadata == {"exp": "x"}


def test_orbax_pytrees_load_bit_exact(orbax_roots) -> None:
    needs_pytree()
    for root, steps, fmt in [
        ("v1", [0, 1, 2], None),
        ("v0", [0, 10, 20], None),
        (
            "prefixed",
            [5, 15],
            cp.training.standard_name_format(step_prefix="step", step_format_fixed_length=5),
        ),
    ]:
        ckptr = cp.training.Checkpointer(orbax_roots / root, step_name_format=fmt)
        for step in steps:
            loaded = ckptr.load_pytree(step)
            expected = orbax_writer.state(step)
            assert np.array_equal(np.asarray(loaded["a"]), expected["a"]), (root, step)
            assert np.asarray(loaded["a"]).dtype == np.int32
            got = np.asarray(loaded["b"]["c"])
            assert got.dtype == np.float32 and np.array_equal(got, expected["b"]["c"]), (root, step)


# Steps Orbax wrote with metrics (a reserved ``metrics/`` item): root -> (steps, items).
METRIC_ROOTS = {
    "v1": ([0, 1, 2], {"state"}),
    "v0_metrics": ([0, 1, 2], {"state", "extra"}),
    "v1_items": ([0, 1], {"state", "extra"}),
}
METRIC_STEPS = [(root, step) for root, (steps, _) in METRIC_ROOTS.items() for step in steps]


def expected_metrics(root: str, step: int) -> dict:
    return {"loss": 1.0 / (step + 1)} if root == "v1" else orbax_writer.metrics(step)


def check_items(loaded: dict, root: str, step: int) -> None:
    assert set(loaded) == METRIC_ROOTS[root][1]
    expected = orbax_writer.state(step)
    assert np.array_equal(np.asarray(loaded["state"]["a"]), expected["a"])
    assert np.array_equal(np.asarray(loaded["state"]["b"]["c"]), expected["b"]["c"])
    if root == "v0_metrics":  # A JSON item.
        assert loaded["extra"] == orbax_writer.extra(step)
    elif root == "v1_items":  # Orbax V1 saved the JSON-like dict as a pytree.
        assert int(np.asarray(loaded["extra"]["step"])) == step
        assert str(loaded["extra"]["name"]) == f"s{step}"


@pytest.mark.parametrize(("root", "step"), METRIC_STEPS)
def test_orbax_steps_with_metrics_load_and_report_their_metrics(orbax_roots, root, step) -> None:
    needs_pytree()
    path = orbax_roots / root / str(step)
    metrics = expected_metrics(root, step)
    check_items(cp.load_checkpointables(path), root, step)
    meta = cp.checkpointables_metadata(path)
    assert set(meta.metadata) == METRIC_ROOTS[root][1]  # The metrics item is not one.
    assert meta.metrics == metrics
    assert cp.pytree_metadata(path).metrics == metrics
    with pytest.raises(KeyError, match="metrics"):  # Reserved: not loadable by name.
        cp.load_checkpointables(path, {"metrics": None})
    ckptr = cp.training.Checkpointer(orbax_roots / root)
    check_items(ckptr.load_checkpointables(step), root, step)
    assert ckptr.checkpointables_metadata(step).metrics == metrics
    assert ckptr.metadata(step).metrics == metrics
    assert [s.metrics for s in ckptr.steps() if s.step == step] == [metrics]


@pytest.mark.parametrize(("root", "step"), METRIC_STEPS)
def test_verify_and_inspect_pass_on_orbax_steps_with_metrics(
    orbax_roots, root, step, capsys
) -> None:
    needs_pytree()
    from checkpointables import cli

    path = str(orbax_roots / root / str(step))
    assert cli.main(["verify", path]) == 0, capsys.readouterr().out
    report = capsys.readouterr().out
    assert "metrics: ok" in report and "all checks passed" in report
    assert cli.main(["inspect", path]) == 0
    shown = capsys.readouterr().out
    assert f"metrics: {expected_metrics(root, step)}" in shown
    assert "\nmetrics/" not in shown and "cannot read" not in shown


def test_damaged_orbax_metrics_are_reported_and_loads_still_work(orbax_roots, tmp_path, capsys):
    needs_pytree()
    from checkpointables import cli

    root = copy_of(orbax_roots / "v0_metrics", tmp_path)
    (root / "1" / "metrics" / "metrics").write_text('{"loss": ')
    assert cli.main(["verify", str(root / "1")]) == 1
    assert "metrics: FAILED" in capsys.readouterr().out
    with pytest.raises(cp.errors.MetadataError, match="metrics/metrics"):
        cp.checkpointables_metadata(root / "1")
    check_items(cp.load_checkpointables(root / "1"), "v0_metrics", 1)
    # Listed without metrics (logged): one damaged file must not stop a run from resuming.
    steps = cp.training.Checkpointer(root).steps()
    assert [(s.step, s.metrics) for s in steps][:2] == [(0, orbax_writer.metrics(0)), (1, {})]
