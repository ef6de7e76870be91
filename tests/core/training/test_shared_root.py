"""Two Checkpointers on one root (a trainer and an evaluator, or two in one process): what
one finds the other did (a step deleted, a step committed) is said as it is and listed."""

from __future__ import annotations

import os

import checkpointables as cp
import numpy as np
import pytest
from checkpointables import _enclosing

P = cp.training.preservation_policies


def _trainer_and_evaluator(root) -> tuple[cp.training.Checkpointer, cp.training.Checkpointer]:
    """A trainer keeping one step, at step 1 (step 0 deleted), and an evaluator listing [1];
    then the trainer saves step 2, which deletes step 1."""
    trainer = cp.training.Checkpointer(root, preservation_policy=P.LatestN(1))
    for step in (0, 1):
        trainer.save_pytree(step, {"a": np.full(3, step)}, force=True)
    trainer.wait()
    evaluator = cp.training.Checkpointer(root)
    assert [s.step for s in evaluator.steps()] == [1]
    trainer.save_pytree(2, {"a": np.full(3, 2)}, force=True)
    trainer.wait()
    return trainer, evaluator


def test_an_evaluator_loading_the_latest_step_moves_past_one_deleted(tmp_path) -> None:
    trainer, evaluator = _trainer_and_evaluator(tmp_path)
    assert evaluator.latest_step().step == 1  # Stale until a load finds it gone.
    # The latest step it listed was deleted: it reloads once, and loads the latest one now.
    assert evaluator.load_pytree()["a"].tolist() == [2, 2, 2]
    assert [s.step for s in evaluator.steps()] == [2]
    assert evaluator.pytree_metadata().metrics == {}
    trainer.close()


def test_a_step_found_deleted_is_no_longer_listed(tmp_path) -> None:
    trainer, evaluator = _trainer_and_evaluator(tmp_path)
    deleted = r"Step 1 was deleted.*reload\(\)"
    with pytest.raises(cp.training.errors.StepNotFoundError, match=deleted):
        evaluator.load_pytree(1)
    assert evaluator.steps() == [] and evaluator.latest_step() is None
    with pytest.raises(cp.training.errors.StepNotFoundError):  # Asked for by number: not moved.
        evaluator.metadata(1)
    # Nothing listed because a load found the step deleted: the latest step is looked for.
    assert evaluator.load_pytree()["a"].tolist() == [2, 2, 2]
    assert evaluator.latest_step().step == 2
    # The metadata of the latest step moves past a deleted one too.
    trainer.save_pytree(3, {"a": np.full(3, 3)}, force=True)
    trainer.wait()
    assert evaluator.pytree_metadata().metadata is not None
    assert evaluator.latest_step().step == 3
    trainer.close()


def test_a_step_another_checkpointer_committed_is_called_committed(tmp_path) -> None:
    first, second = cp.training.Checkpointer(tmp_path), cp.training.Checkpointer(tmp_path)
    first.save_pytree(0, {"a": np.arange(3)}, force=True)
    with pytest.raises(cp.training.errors.StepAlreadyExistsError) as raised:
        second.save_pytree(0, {"a": np.arange(3)}, force=True)
    message = str(raised.value)
    assert "holds a committed checkpoint" in message and "reload()" in message
    assert "not a committed" not in message
    (tmp_path / "1").mkdir()  # Not a checkpoint: said so.
    with pytest.raises(cp.training.errors.StepAlreadyExistsError, match="not a committed"):
        second.save_pytree(1, {"a": np.arange(3)}, force=True)
    with pytest.raises(cp.training.errors.StepAlreadyExistsError, match="holds a committed"):
        first.save_pytree(0, {"a": np.arange(3)}, force=True)  # Its own: listed.


def test_a_root_inside_a_finished_checkpoint_is_refused_at_creation(tmp_path) -> None:
    ck = tmp_path / "ck"
    cp.save_pytree(ck, {"a": np.arange(3)})
    before = sorted(os.walk(ck))
    for root in (ck / "run", ck / "pytree" / "run"):
        refused = f"inside the finished checkpoint {ck}"
        with pytest.raises(cp.errors.InvalidArgumentError, match=refused):
            cp.training.Checkpointer(root, custom_metadata={"x": 1})
    assert sorted(os.walk(ck)) == before  # Not even the root's metadata.


def test_step_saves_look_for_an_enclosing_checkpoint_as_free_saves_do(
    tmp_path, monkeypatch
) -> None:
    looks: list[str] = []
    real = _enclosing._parents  # Every look at a save's parents lists them first.

    def counted(path):
        looks.append(os.fspath(path))
        return real(path)

    monkeypatch.setattr(_enclosing, "_parents", counted)
    with cp.training.Checkpointer(tmp_path / "run") as checkpointer:
        opened = len(looks)
        for step in range(3):
            checkpointer.save_pytree(step, {"a": np.arange(3)}, force=True)
    steps = looks[opened:]
    assert len(steps) == 2 * 3, steps  # Each step as it starts, and at its commit.
    cp.save_pytree(tmp_path / "free", {"a": np.arange(3)})
    assert looks[opened + len(steps) :] == [os.fspath(tmp_path / "free")] * 2
