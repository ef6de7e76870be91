"""``overwrite=True`` replaces a checkpoint (finished, damaged, or an unfinished save's), never
a directory of checkpoints or files no save wrote (docs/quickstart.md, "Nothing is lost")."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import Any

import checkpointables as cp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TREE = {"w": np.arange(3.0)}
CHECKPOINT_FILES = (
    "_CHECKPOINT_METADATA",
    "_CHECKSUMS",
    "commit_success.txt",
    "orbax.checkpoint",
    ".checkpointables-save",
)
LEFTOVERS = ("x.checkpointables-tmp-1-2-ab", "x.orbax-checkpoint-tmp", "y.orbax-checkpoint-tmp-7")


def _tree(path: pathlib.Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def test_a_checkpointer_root_is_never_replaced(tmp_path) -> None:
    root = tmp_path / "g"
    with cp.training.Checkpointer(root) as checkpointer:
        for step in (0, 1):
            checkpointer.save_pytree(step, TREE, force=True)
    before = _tree(root)
    for overwrite in (True, False):
        with pytest.raises(FileExistsError, match=r"Checkpointer's root .* with steps 0, 1") as e:
            cp.save_pytree(root, {"w": np.ones(2)}, overwrite=overwrite)
        assert isinstance(e.value, cp.errors.CheckpointExistsError)
        assert f"Save to {root}/<step>" in str(e.value)
        assert "old checkpoint" not in str(e.value)
    assert _tree(root) == before
    np.testing.assert_array_equal(cp.load_pytree(root / "1")["w"], TREE["w"])


def test_user_files_and_a_file_are_never_replaced(tmp_path) -> None:
    mine = tmp_path / "mydata"
    (mine / "experiments").mkdir(parents=True)
    (mine / "experiments" / "results.csv").write_text("1,2\n")
    (mine / "a.csv").write_text("x")
    with pytest.raises(cp.errors.CheckpointExistsError, match="not a checkpoint: a.csv, exp"):
        cp.save_pytree(mine, TREE, overwrite=True)
    with pytest.raises(FileExistsError, match="remove them yourself"):
        cp.save_pytree(mine, TREE)
    assert _tree(mine) == {"a.csv": b"x", "experiments/results.csv": b"1,2\n"}
    waiting = tmp_path / "waiting"  # Partial saves waiting for finalize: no leftovers.
    (waiting / "ck.partial_save").mkdir(parents=True)
    with pytest.raises(cp.errors.CheckpointExistsError, match="not a checkpoint: ck.partial_save"):
        cp.save_pytree(waiting, TREE, overwrite=True)
    (tmp_path / "f").write_text("keep")
    with pytest.raises(cp.errors.CheckpointExistsError, match="is a file, not a checkpoint"):
        cp.save_pytree(tmp_path / "f", TREE, overwrite=True)
    assert (tmp_path / "f").read_text() == "keep"


def test_what_a_save_may_replace(tmp_path) -> None:
    finished = tmp_path / "finished"
    cp.save_pytree(finished, TREE)
    lost = tmp_path / "lost"  # Committed, then lost its metadata: damaged.
    cp.save_pytree(lost, TREE)
    (lost / "_CHECKPOINT_METADATA").unlink()
    leftovers = tmp_path / "leftovers"
    for name in LEFTOVERS:
        (leftovers / name).mkdir(parents=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, what in [
        (finished, "holds a checkpoint. Pass overwrite=True"),
        (lost, "damaged or was not finished .*_CHECKSUMS"),
        (leftovers, "only temporary directories of saves that did not finish"),
        (empty, r"exists \(an empty directory\)"),
    ]:
        with pytest.raises(cp.errors.CheckpointExistsError, match=what):
            cp.save_pytree(path, TREE)
        cp.save_pytree(path, {"w": np.ones(2)}, overwrite=True)
        np.testing.assert_array_equal(cp.load_pytree(path)["w"], np.ones(2))


def check_overwrite(path: Any, ours: bool, contents: Callable[[Any], object]) -> None:
    """Saves to ``path`` with ``overwrite=True``: it replaces what is there if that is ``ours``
    (a checkpoint, leftovers of saves), else raises and leaves every file as it was."""
    before = contents(path)
    try:
        cp.save_pytree(path, TREE, overwrite=True)
    except cp.errors.CheckpointExistsError:
        assert not ours, before
        assert contents(path) == before
    else:
        assert ours, before
        assert cp.is_checkpoint(path)


_NAMES = st.one_of(
    st.sampled_from(CHECKPOINT_FILES + LEFTOVERS + ("0", "1", "pytree", "data.csv")),
    st.text("abcXYZ019_.-", min_size=1, max_size=8).filter(lambda n: n not in (".", "..")),
)


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(entries=st.dictionaries(_NAMES, st.booleans(), max_size=5))
def test_overwrite_removes_only_checkpoints_and_leftovers(tmp_path_factory, entries) -> None:
    path = tmp_path_factory.mktemp("prop") / "target"
    path.mkdir()
    for name, is_dir in entries.items():
        if is_dir:
            (path / name).mkdir()
            (path / name / "inside").write_text(name)
        else:
            (path / name).write_text(name)
    ours = any(not d and n in CHECKPOINT_FILES for n, d in entries.items()) or all(
        ".checkpointables-tmp-" in n or ".orbax-checkpoint-tmp" in n for n in entries
    )
    check_overwrite(path, ours, _tree)
    assert sorted(os.listdir(path.parent)) == ["target"]  # No temporary directory is left.
