"""A pytree records which distributions' leaf handlers wrote its leaves; a load without one
names the leaf handler and the distribution to install (the tests' example plugin)."""

from __future__ import annotations

import json

import checkpointables as cp
import numpy as np
import pytest
from checkpointables.testing import missing_handler_message
from checkpointables_example_point import Point
from checkpointables_pytree import _leaf_distributions

_HANDLER = "checkpointables_example_point.PointLeafHandler"
_INSTALL = "pip install 'checkpointables-example-point==0.1.0'"


def _record(path) -> object:
    document = json.loads((path / "pytree" / "_METADATA").read_text())
    return document["checkpointables"].get(_leaf_distributions.FIELD)


def test_a_save_records_the_plugin_distribution_of_its_custom_leaves_only(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", {"p": Point(1, 2.5), "a": np.arange(3)})
    assert _record(tmp_path / "c") == {
        _HANDLER: {"distribution": "checkpointables-example-point", "version": "0.1.0"}
    }
    cp.save_pytree(tmp_path / "plain", {"a": np.arange(3), "s": "text", "n": 1})
    assert _record(tmp_path / "plain") is None  # The pytree plugin's own: not recorded.


def test_loading_without_the_plugin_names_the_handler_and_what_to_install(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", {"q": Point(1, 2.5), "a": np.arange(3)})
    message = missing_handler_message(tmp_path / "c", ["example-point"])
    assert (
        f"['q'] were saved by the leaf handler {_HANDLER}, from the distribution "
        f"checkpointables-example-point 0.1.0: {_INSTALL}" in message
    ), message
    assert "value type" not in message and "pass a registry" not in message
    assert str(tmp_path / "c" / "pytree") in message


def test_without_the_handler_in_the_registry_the_message_is_the_same(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", {"q": Point(1, 2.5)})
    registry = cp.serialization.LeafHandlerRegistry()  # As if the plugin were uninstalled.
    options = cp.options.PyTreeOptions(leaf_handler_registry=registry)
    with cp.Context(pytree_options=options), pytest.raises(cp.errors.MissingHandlerError) as e:
        cp.load_pytree(tmp_path / "c")
    assert f"from the distribution checkpointables-example-point 0.1.0: {_INSTALL}" in str(e.value)


@pytest.mark.parametrize(
    "record",
    [
        {_HANDLER: {"distribution": "evil; rm -rf /", "version": "0.1.0"}},
        {_HANDLER: {"distribution": ["x"], "version": "0.1.0"}},
        {f"x.H{i}": {"distribution": "d", "version": "1"} for i in range(100)} | {_HANDLER: {}},
        "not a mapping",
    ],
    ids=["bad-name", "not-a-string", "too-many", "not-a-mapping"],
)
def test_a_damaged_or_forged_record_is_ignored(tmp_path, record) -> None:
    assert _leaf_distributions.recorded({_leaf_distributions.FIELD: record}, _HANDLER) is None
    message = _leaf_distributions.missing_message(
        {_HANDLER: ["['q']"]}, {_leaf_distributions.FIELD: record}
    )
    assert "pip install" not in message and "pass a registry holding it" in message


def test_an_unrecorded_custom_handler_is_named_as_a_leaf_handler(tmp_path) -> None:
    message = _leaf_distributions.missing_message({"my.module.QuantLeafHandler": ["['w']"]}, {})
    assert message.startswith(
        "No leaf handler registered here reads some leaves. ['w'] were saved by the leaf "
        "handler my.module.QuantLeafHandler"
    )


def test_a_disabled_plugin_is_named_as_disabled_not_to_install(tmp_path, monkeypatch) -> None:
    cp.save_pytree(tmp_path / "c", {"q": Point(1, 2.5)})
    monkeypatch.setenv(cp.plugins.DISABLE_ENV_VAR, "example-point")
    cp.plugins.refresh()  # Discovery sees the variable.
    try:
        with pytest.raises(cp.errors.MissingHandlerError) as raised:
            cp.load_pytree(tmp_path / "c")
    finally:
        monkeypatch.undo()
        cp.plugins.refresh()
    message = str(raised.value)
    assert "from the distribution checkpointables-example-point 0.1.0. It is provided by " in (
        message
    )
    assert "disabled by CHECKPOINTABLES_DISABLE_PLUGINS" in message and "pip install" not in message


def test_a_finalized_partial_save_keeps_the_record_of_every_part(tmp_path) -> None:
    cp.partial.save(tmp_path / "c", {"q": Point(1, 2.5)})
    cp.partial.save(tmp_path / "c", {"a": np.arange(3)})
    cp.partial.finalize(tmp_path / "c")
    assert _HANDLER in _record(tmp_path / "c")  # The first part's, kept by the merge.
