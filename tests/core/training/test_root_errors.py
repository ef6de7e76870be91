"""A Checkpointer whose root is, or lies under, a file: the library's ``PathIsAFileError``
at construction (as a free function's save there raises), naming the file, creating nothing."""

from __future__ import annotations

import os

import checkpointables as cp
import numpy as np
import pytest
from checkpointables.storage import PathIsAFileError


@pytest.mark.parametrize("below", ["", "sub", "sub/deeper"])
def test_a_root_at_or_under_a_file_is_refused_at_construction(tmp_path, below) -> None:
    blocking = tmp_path / "afile"
    blocking.write_text("")
    root = blocking / below if below else blocking
    with pytest.raises(PathIsAFileError) as e:
        cp.training.Checkpointer(root)
    assert isinstance(e.value, cp.errors.InvalidArgumentError)
    assert isinstance(e.value, NotADirectoryError)  # As before: the builtin meaning kept.
    message = str(e.value)
    assert message.startswith(f"{blocking} is a file, not a directory")
    assert "a Checkpointer needs a directory" in message and "move" in message
    assert (f"(in the path {root})" in message) == bool(below)
    assert sorted(os.listdir(tmp_path)) == ["afile"] and blocking.is_file()


def test_a_relative_root_is_named_as_written(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    open("afile", "w").close()
    with pytest.raises(PathIsAFileError, match=r"^afile is a file.*\(in the path afile/sub\)"):
        cp.training.Checkpointer("afile/sub")
    # The free function says the same kind of thing, with the same type.
    with pytest.raises(PathIsAFileError, match="afile is a file"):
        cp.save_pytree("afile/x", {"a": np.ones(1)})


def test_a_root_under_directories_is_fine(tmp_path) -> None:
    (tmp_path / "a").mkdir()
    with cp.training.Checkpointer(tmp_path / "a" / "b" / "run") as ckptr:
        assert ckptr.save_pytree(0, {"a": np.ones(1)})
    assert [s.step for s in cp.training.Checkpointer(tmp_path / "a" / "b" / "run").steps()] == [0]
