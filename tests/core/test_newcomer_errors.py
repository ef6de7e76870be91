"""Errors a newcomer meets: a mistyped ``reuse_from`` says what the folder really holds."""

from __future__ import annotations

import checkpointables as cp
import numpy as np
import pytest


def _tree() -> dict[str, np.ndarray]:
    return {"a": np.arange(4, dtype=np.float32)}


@pytest.fixture
def one_offs(tmp_path):
    """A folder of unrelated one-off saves (no steps)."""
    for name in ("t9a", "baseline", "nonexisting", "x1", "x2", "x3"):
        cp.save_pytree(tmp_path / "w" / name, _tree())
    return tmp_path / "w"


def test_a_typo_among_one_off_saves_lists_them_closest_first(one_offs) -> None:
    with pytest.raises(cp.errors.CheckpointNotFoundError) as raised:
        cp.save_pytree(one_offs / "x", _tree(), reuse_from=one_offs / "nonexist")
    message = str(raised.value)
    assert "steps" not in message  # Not a training root.
    assert (
        f"{one_offs} holds the checkpoints nonexisting, baseline, t9a, x1, x2 and 1 more "
        f"(closest to 'nonexist' first): did you mean reuse_from={one_offs / 'nonexisting'}?"
    ) in message
    assert not (one_offs / "x").exists()


def test_no_arbitrary_checkpoint_is_suggested(one_offs) -> None:
    with pytest.raises(cp.errors.CheckpointNotFoundError) as raised:
        cp.save_pytree(one_offs / "x", _tree(), reuse_from=one_offs / "zzz")
    message = str(raised.value)
    assert (
        f"{one_offs} holds the checkpoints baseline, nonexisting, t9a, x1, x2 and 1 more, "
        f"none named like 'zzz': pass the one to reuse from, reuse_from={one_offs}/<name>."
    ) in message
    assert "e.g." not in message and "steps" not in message
    # The folder itself: the same listing, nothing picked.
    with pytest.raises(cp.errors.NotACheckpointError) as raised:
        cp.save_pytree(one_offs / "x", _tree(), reuse_from=one_offs)
    assert "holds the checkpoints baseline, nonexisting, t9a" in str(raised.value)
    assert f"reuse_from={one_offs}/<name>." in str(raised.value)


def test_a_training_root_names_its_steps_newest_first(tmp_path) -> None:
    with cp.training.Checkpointer(tmp_path / "run") as ckptr:
        for step in (2, 10, 30):
            ckptr.save_pytree(step, _tree(), force=True)
    run = tmp_path / "run"
    for typo in ("3", "31"):  # Steps are numbers: the newest, not the most alike spelling.
        with pytest.raises(cp.errors.CheckpointNotFoundError) as raised:
            cp.save_pytree(tmp_path / "x", _tree(), reuse_from=run / typo)
        assert (
            f"{run} holds the steps 30, 10, 2 (newest first): pass one, e.g. "
            f"reuse_from={run / '30'} (the newest)."
        ) in str(raised.value)
