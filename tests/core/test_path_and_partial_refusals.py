"""Bad paths and misused partial saves get a clear library error (not a raw OSError, a
ValueError hiding the real one, or a silent surprise)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import checkpointables as cp
import numpy as np
import pytest
from checkpointables import layout
from etils import epath

_TREE = {"a": np.arange(3.0)}


def test_a_second_bad_partial_save_raises_its_own_error(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    cp.partial.save(path, _TREE)
    with pytest.raises(cp.errors.NoHandlerForObjectError):
        cp.partial.save(path, {"f": lambda x: x})
    with pytest.raises(cp.errors.InvalidArgumentError, match="custom_metadata"):
        cp.partial.save(path, {"b": np.ones(2)}, custom_metadata={"x": object()})
    with pytest.raises(cp.errors.NoHandlerForObjectError):
        cp.partial.save_async(path, {"f": lambda x: x}).result()
    cp.partial.finalize(path)  # The first save is untouched.
    np.testing.assert_array_equal(cp.load_pytree(path)["a"], _TREE["a"])


def test_pieces_of_a_partial_save_are_not_checkpoints(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    cp.partial.save(path, _TREE)
    cp.partial.save(path, {"b": np.ones(2)})
    piece = cp.partial.session_path(path) / "pytree" / "partial-000001"
    assert (piece / "_CHECKPOINT_METADATA").exists()  # On disk it looks like one...
    assert not cp.is_checkpoint(piece)  # ...but holds only the first call's keys.
    with pytest.raises(cp.errors.NotACheckpointError, match="piece of a partial save") as e:
        cp.load_pytree(piece)
    assert "cp.partial.finalize" in str(e.value) and str(path) in str(e.value)
    cp.partial.finalize(path)
    published = path / "pytree" / "partial-000001"
    assert cp.is_checkpoint(path) and not cp.is_checkpoint(published)
    with pytest.raises(cp.errors.NotACheckpointError, match=f"load {path}, the checkpoint"):
        cp.load_pytree(published)
    with pytest.raises(cp.errors.NotACheckpointError, match="piece of a partial save"):
        cp.checkpointables_metadata(published)
    assert set(cp.load_pytree(path)) == {"a", "b"}


def test_a_checkpoint_merely_named_like_a_piece_is_one(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "pytree" / "partial-000001"
    cp.save_pytree(path, _TREE)
    assert cp.is_checkpoint(path)
    np.testing.assert_array_equal(cp.load_pytree(path)["a"], _TREE["a"])


def test_saving_under_a_file_names_the_file(tmp_path: Path) -> None:
    blocking = tmp_path / "afile"
    blocking.write_text("")
    for target in (blocking / "ck", blocking / "deeper" / "ck"):
        with pytest.raises(cp.errors.InvalidArgumentError, match="is a file") as e:
            cp.save_pytree(target, _TREE)
        assert str(blocking) in str(e.value)
        assert isinstance(e.value, NotADirectoryError)
    assert blocking.read_text() == ""


def test_a_leading_tilde_is_the_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    cp.save_pytree("~/ck", _TREE)
    assert cp.is_checkpoint(home / "ck") and not (tmp_path / "~").exists()
    np.testing.assert_array_equal(cp.load_pytree("~/ck")["a"], _TREE["a"])
    with pytest.raises(cp.errors.InvalidArgumentError, match="no user"):
        cp.save_pytree("~no-such-user-zz/ck", _TREE)
    assert not (tmp_path / "~no-such-user-zz").exists()
    cp.save_pytree(epath.Path("~/ep"), _TREE)  # An etils path (cp.path.Path) too.
    assert cp.is_checkpoint(home / "ep") and not (tmp_path / "~").exists()
    cp.save_pytree("./~/ck", _TREE)  # Written so, a directory really named ~.
    assert cp.is_checkpoint(tmp_path / "~" / "ck")


def test_bytes_paths_are_taken_as_open_takes_them(tmp_path: Path) -> None:
    path = os.fsencode(tmp_path / "ck")
    cp.save_pytree(path, _TREE)
    assert cp.is_checkpoint(path)
    np.testing.assert_array_equal(cp.load_pytree(path)["a"], _TREE["a"])
    with pytest.raises(cp.errors.CheckpointNotFoundError):
        cp.load_pytree(os.fsencode(tmp_path / "missing"))
    with pytest.raises(cp.errors.InvalidArgumentTypeError, match="path argument"):
        cp.load_pytree(7)  # type: ignore[arg-type]
    with pytest.raises(cp.errors.InvalidArgumentError, match="not UTF-8"):
        cp.save_pytree(os.fsencode(tmp_path) + b"/c\xff", _TREE)  # No character's bytes.
    assert os.listdir(tmp_path) == ["ck"]


def test_a_directory_of_checkpoints_is_called_a_root_only_for_step_names(
    tmp_path: Path,
) -> None:
    cp.save_pytree(tmp_path / "nx_orbax", _TREE)
    cp.save_pytree(tmp_path / "other", _TREE)
    with pytest.raises(cp.errors.NotACheckpointError) as e:
        cp.load_pytree(tmp_path)
    assert "holding checkpoints other, nx_orbax" in str(e.value)
    assert "step" not in str(e.value)
    steps = tmp_path / "steps"
    cp.save_pytree(steps / "step_7", _TREE)
    with pytest.raises(cp.errors.NotACheckpointError, match="Checkpointer's steps"):
        cp.load_pytree(steps)
    assert layout.checkpoints_holder(["1", "run_2"]).endswith("with steps 1, run_2")
    assert layout.checkpoints_holder(["1", "nx_orbax"]).endswith("checkpoints 1, nx_orbax")


@pytest.mark.parametrize("custom", ["a string", ["a", "list"], 3])
def test_custom_metadata_not_an_object_is_a_metadata_error(tmp_path: Path, custom: object) -> None:
    cp.save_pytree(tmp_path / "ck", _TREE, custom_metadata={"run": 7})
    file = tmp_path / "ck" / "_CHECKPOINT_METADATA"
    meta = json.loads(file.read_text())
    meta["custom_metadata"] = custom
    os.chmod(file, 0o644)
    file.write_text(json.dumps(meta))
    cp.metadata_checksums.record(tmp_path / "ck")  # Damage the checksums cannot see.
    with pytest.raises(cp.errors.MetadataError, match="'custom_metadata' must be an object") as e:
        cp.checkpointables_metadata(tmp_path / "ck")
    assert str(file) in str(e.value)


def test_a_parent_that_becomes_a_checkpoint_while_finalize_merges_stops_its_commit(
    tmp_path: Path,
) -> None:
    # A pytree handler registered through the public API (cp.handlers.register_handler,
    # ahead of the plugin's under its name; a cp.protocols.Mergeable) does finalize's
    # merge: it lets another writer commit a/ after finalize's first look, then merges.
    from .test_save_inside_checkpoint import _commit_elsewhere

    path = tmp_path / "a" / "p"
    cp.partial.save(path, _TREE)
    shipped = cp.handlers.get("pytree")

    class CommitsParentMeanwhile(shipped):  # type: ignore[misc, valid-type]
        async def merge_partial(self, sources, target) -> None:
            _commit_elsewhere(tmp_path, tmp_path / "a")
            await super().merge_partial(sources, target)

    cp.handlers.register_handler(CommitsParentMeanwhile, name="pytree", priority=0)
    try:
        with pytest.raises(cp.errors.InvalidArgumentError, match="about to commit") as refused:
            cp.partial.finalize(path)
    finally:
        cp.handlers.unregister_handler(CommitsParentMeanwhile)
    assert "the partial saves were not published" in str(refused.value)
    assert not path.exists() and cp.storage.exists(cp.partial.session_path(path))
