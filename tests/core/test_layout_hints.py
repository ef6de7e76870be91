"""A load of something that is not a checkpoint but holds or is inside one names the
checkpoint to load instead (``layout.where_instead``, shared with the command line)."""

from __future__ import annotations

import os

import checkpointables as cp
import numpy as np
import pytest


def _not_a_checkpoint(path) -> str:
    with pytest.raises(cp.errors.NotACheckpointError) as info:
        cp.load_pytree(path)
    return str(info.value)


def test_a_checkpointable_folder_names_its_checkpoint(tmp_path) -> None:
    cp.save_pytree(tmp_path / "a", {"w": np.arange(3)})
    text = _not_a_checkpoint(tmp_path / "a" / "pytree")
    checkpoint = os.fspath(tmp_path / "a")
    assert f"inside the checkpoint {checkpoint}, in its checkpointable 'pytree'" in text
    assert f"cp.load_pytree({checkpoint!r}, checkpointable_name='pytree')" in text
    assert "`checkpointables" not in text  # The command line's wording.


def test_a_relative_checkpointable_folder_too(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cp.save_pytree("a", {"w": np.arange(3)})
    text = _not_a_checkpoint("a/pytree")
    assert "cp.load_pytree('a', checkpointable_name='pytree')" in text


def test_a_local_tier_step_is_not_called_a_root(tmp_path) -> None:
    tier = cp.training.LocalTier(tmp_path / "local")
    with cp.training.Checkpointer(tmp_path / "persistent", local_tier=tier) as ckptr:
        ckptr.save_pytree(130, {"w": np.arange(3)}, force=True)
    copy = os.fspath(tmp_path / "local" / "130" / "p0-of-1")
    text = _not_a_checkpoint(tmp_path / "local" / "130")
    assert "root of several checkpoints" not in text
    assert "step of a local tier (docs/local-tier.md): each host's copy of it is a " in text
    assert "the Checkpointer whose local_tier saved it (ckptr.load_pytree(step))" in text
    assert f"or load the copy, cp.load_pytree({copy!r}): one process saved it" in text
    text = _not_a_checkpoint(tmp_path / "local")
    assert "local tier's directory (docs/local-tier.md)" in text and copy in text
    assert "newest step with the Checkpointer whose local_tier it is" in text


def test_a_root_names_its_newest_step(tmp_path) -> None:
    root = tmp_path / "runs"
    with cp.training.Checkpointer(root) as ckptr:
        for step in (2, 10):
            ckptr.save_pytree(step, {"w": np.arange(3)}, force=True)
    text = _not_a_checkpoint(root)
    newest = os.fspath(root / "10")
    assert "root of several checkpoints (a Checkpointer's steps): load one of its" in text
    assert f"the newest is {newest}: cp.load_pytree({newest!r})" in text


def test_a_directory_of_other_things_gets_no_hint(tmp_path) -> None:
    (tmp_path / "plain" / "sub").mkdir(parents=True)
    text = _not_a_checkpoint(tmp_path / "plain")
    assert text.endswith("or it is not a checkpoint.")
