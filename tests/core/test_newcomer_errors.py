"""What a newcomer meets: a mistyped ``reuse_from`` says what the folder really holds; a
pytree with no leaves (an NNX GraphDef) is saved, with a warning."""

from __future__ import annotations

import logging

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


def _graphdef():
    nnx = pytest.importorskip("flax.nnx")  # A test dependency; the core needs no Flax.
    graphdef, _ = nnx.split(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    return graphdef


def _leafless_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "has no leaves" in r.getMessage()]


def test_a_pytree_without_leaves_is_saved_with_one_warning(tmp_path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="checkpointables"):
        cp.save_pytree(tmp_path / "g", {"g": _graphdef()})
    [warning] = _leafless_warnings(caplog)
    assert f"The pytree 'pytree' saved to {tmp_path / 'g'} has no leaves" in warning
    assert "nothing but its structure was saved" in warning
    assert "['g'] (flax.nnx." in warning and "nnx.split" in warning
    assert ".checkpointables-tmp-" not in warning  # The checkpoint's own path.
    assert cp.load_pytree(tmp_path / "g") == {"g": {}}  # Saved as JAX sees it.
    # Through save_checkpointables too (the pytree handler picks it), named by its name.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="checkpointables"):
        empty = pytest.importorskip("optax").EmptyState()
        cp.save_checkpointables(tmp_path / "h", {"opt": (empty,)})
    [warning] = _leafless_warnings(caplog)
    assert f"The pytree 'opt' saved to {tmp_path / 'h'}" in warning
    assert "[0] (optax" in warning


def test_a_checkpointer_warns_once_per_root(tmp_path, caplog) -> None:
    graphdef = _graphdef()
    with (
        caplog.at_level(logging.WARNING, logger="checkpointables"),
        cp.training.Checkpointer(tmp_path / "run") as ckptr,
    ):
        for step in range(3):
            ckptr.save_pytree(step, {"g": graphdef}, force=True)
    [warning] = _leafless_warnings(caplog)
    assert f"saved to {tmp_path / 'run' / '0'} has no leaves" in warning


@pytest.mark.parametrize("tree", [{}, [], {"a": {}, "b": [], "c": None}])
def test_explicitly_empty_containers_are_not_warned_about(tmp_path, caplog, tree) -> None:
    with caplog.at_level(logging.WARNING, logger="checkpointables"):
        cp.save_pytree(tmp_path / "e", tree)
    assert _leafless_warnings(caplog) == []
    assert cp.load_pytree(tmp_path / "e") == tree  # Exactly what was saved.


def test_a_tree_with_leaves_and_empty_nodes_is_not_warned_about(tmp_path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="checkpointables"):
        cp.save_pytree(tmp_path / "p", {"w": np.ones(1), "g": _graphdef()})
    assert _leafless_warnings(caplog) == []
