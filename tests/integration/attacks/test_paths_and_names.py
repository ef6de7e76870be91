"""Paths and names a user may pass: ``..`` in a path, names too long for the filesystem.

Each either works or fails with a library error before anything is created.
"""

from __future__ import annotations

import os
import traceback

import checkpointables as cp
import numpy as np
import pytest

from .checkpoints import is_exactly_saved, saved_values


def test_a_path_with_dotdot_saves_and_loads_where_the_system_resolves_it(tmp_path) -> None:
    (tmp_path / "runs").mkdir()
    path = tmp_path / "runs" / ".." / "ckpt"
    cp.save_checkpointables(path, saved_values())
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "runs"]
    assert os.listdir(tmp_path / "runs") == []
    assert is_exactly_saved(cp.load_checkpointables(path))
    assert is_exactly_saved(cp.load_checkpointables(tmp_path / "ckpt"))
    cp.save_pytree(tmp_path / "runs" / ".." / "p", {"x": np.arange(3)})
    np.testing.assert_array_equal(cp.load_pytree(tmp_path / "p")["x"], np.arange(3))


def test_a_relative_path_with_dotdot_works(tmp_path, monkeypatch) -> None:
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    cp.save_pytree("../rel", {"x": np.arange(2)})
    np.testing.assert_array_equal(cp.load_pytree("../rel")["x"], np.arange(2))


@pytest.mark.parametrize(
    ("path", "items"),
    [
        ("c" * 250, {"pytree": {"x": 1}}),  # Fits alone; its temporary name would not.
        ("ok", {"n" * 300: {"x": 1}}),
    ],
    ids=["checkpoint-name", "checkpointable-name"],
)
def test_a_name_too_long_fails_before_anything_is_written(tmp_path, path, items) -> None:
    with pytest.raises(cp.errors.NameTooLongError) as info:
        cp.save_checkpointables(tmp_path / path, items)
    assert isinstance(info.value, OSError) and info.value.errno == 36
    assert "shorter" in str(info.value)
    assert os.listdir(tmp_path) == []


def test_errors_do_not_chain_to_an_event_loop_lookup(tmp_path) -> None:
    with pytest.raises(cp.errors.NameTooLongError) as info:
        cp.save_checkpointables(tmp_path / "ok", {"n" * 300: {"x": 1}})
    text = "".join(traceback.format_exception(info.value))
    assert "no running event loop" not in text
    with pytest.raises(cp.errors.CheckpointNotFoundError) as missing:
        cp.load_pytree(tmp_path / "nothing")
    assert isinstance(missing.value, FileNotFoundError)
    assert "no running event loop" not in "".join(traceback.format_exception(missing.value))


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda p: cp.save_checkpointables(p / "new", {}), cp.errors.InvalidArgumentError),
        (lambda p: cp.save_checkpointables(p / "new", {"a/b": 1}), cp.errors.InvalidArgumentError),
        (lambda p: cp.save_pytree(p / "new", None), cp.errors.InvalidArgumentError),
        (
            lambda p: cp.save_pytree(p / "new", {"x": 1}, custom_metadata={"a": object()}),
            ValueError,
        ),
        (lambda p: cp.save_pytree(p / "old", {"x": 1}), cp.errors.CheckpointExistsError),
        (lambda p: cp.load_checkpointables(p / "old", [1]), cp.errors.InvalidArgumentError),
        (lambda p: cp.load_pytree(p / "new"), cp.errors.CheckpointNotFoundError),
        (lambda p: cp.load_pytree(123), cp.errors.InvalidArgumentTypeError),
        (lambda p: cp.save_pytree(None, {"x": 1}), cp.errors.InvalidArgumentTypeError),
    ],
)
def test_bad_arguments_are_library_errors_keeping_their_builtin_class(tmp_path, call, error):
    cp.save_pytree(tmp_path / "old", {"x": 1})
    with pytest.raises(error) as info:
        call(tmp_path)
    assert isinstance(info.value, cp.errors.CheckpointError)
