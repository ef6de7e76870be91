"""Orbax ``ocp.args`` wrappers passed where checkpointables wants the object itself get a
short error naming the wrapper and what to pass, not the list of handlers tried."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import checkpointables as cp
import numpy as np
import orbax.checkpoint as ocp
import pytest

TREE = {"w": np.arange(4.0)}


def _wrappers() -> list[tuple[str, Any]]:
    return [
        ("StandardSave", ocp.args.StandardSave(TREE)),
        ("PyTreeSave", ocp.args.PyTreeSave(TREE)),
        ("JsonSave", ocp.args.JsonSave({"lr": 0.1})),
    ]


@pytest.mark.parametrize(("label", "wrapper"), _wrappers(), ids=lambda x: str(x)[:20])
def test_save_checkpointables_names_the_wrapper(tmp_path: Path, label: str, wrapper: Any):
    with pytest.raises(cp.errors.NoHandlerForObjectError) as raised:
        cp.save_checkpointables(tmp_path / "ckpt", {"state": wrapper})
    message = str(raised.value)
    assert f"ocp.args.{label}" in message
    assert "Orbax Checkpoint argument wrapper" in message
    assert "{'state': pytree}" in message
    assert "Handlers tried" not in message
    assert not (tmp_path / "ckpt").exists()


def test_save_pytree_names_the_wrapper(tmp_path: Path):
    with pytest.raises(cp.errors.NoHandlerForObjectError) as raised:
        cp.save_pytree(tmp_path / "ckpt", ocp.args.StandardSave(TREE))
    message = str(raised.value)
    assert "ocp.args.StandardSave" in message
    assert "cp.save_pytree(path, pytree)" in message
    assert "leaf handler" not in message


def test_composite_asks_for_a_dict_of_its_items(tmp_path: Path):
    composite = ocp.args.Composite(
        state=ocp.args.StandardSave(TREE), meta=ocp.args.JsonSave({"lr": 0.1})
    )
    for save in (
        lambda: cp.save_checkpointables(tmp_path / "a", {"all": composite}),
        lambda: cp.save_pytree(tmp_path / "b", composite),
    ):
        with pytest.raises(cp.errors.NoHandlerForObjectError) as raised:
            save()
        message = str(raised.value)
        assert "ocp.args.Composite" in message
        assert "cp.save_checkpointables(path, {'state': <state>, 'meta': <meta>})" in message


def test_load_with_a_restore_wrapper_names_it(tmp_path: Path):
    cp.save_pytree(tmp_path / "ckpt", TREE)
    with pytest.raises(cp.errors.InvalidArgumentTypeError) as raised:
        cp.load_pytree(tmp_path / "ckpt", ocp.args.StandardRestore(TREE))
    assert "ocp.args.StandardRestore" in str(raised.value)
    assert "cp.load_pytree(path, abstract_pytree)" in str(raised.value)


def test_a_plain_pytree_still_saves(tmp_path: Path):
    cp.save_checkpointables(tmp_path / "ckpt", {"state": TREE, "meta": {"lr": 0.1}})
    loaded = cp.load_checkpointables(tmp_path / "ckpt")
    np.testing.assert_array_equal(loaded["state"]["w"], TREE["w"])


@pytest.mark.parametrize("module", [None, 5])
def test_a_class_whose_module_is_not_text_gets_the_usual_error(tmp_path: Path, module):
    # Protobuf messages have no module (None); a user may assign anything.
    unknown = type("Unknown", (), {})
    unknown.__module__ = module
    with pytest.raises(cp.errors.NoHandlerForObjectError, match="'thing'"):
        cp.save_checkpointables(tmp_path / "ckpt", {"thing": unknown()})
