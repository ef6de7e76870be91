"""JSON checkpointables and the real orbax-checkpoint (0.12.8): each reads the other's.

Checkpoints record Orbax's ``JsonHandler`` typestr for them, so Orbax's
``load_checkpointables`` finds its own JSON handler, which reads our
``data.json``.
"""

from __future__ import annotations

import checkpointables as cp
import numpy as np
import pytest
from orbax.checkpoint import v1 as ocp_v1

pytestmark = pytest.mark.filterwarnings(
    "ignore:Sharding info not provided when restoring:UserWarning"
)
CONFIG = {"lr": 3e-4, "layers": [64, 64], "name": "run-7", "flags": {"bf16": True, "seed": None}}


def test_orbax_loads_our_json_checkpointables(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "c", {"state": {"w": np.arange(3.0)}, "config": CONFIG})
    loaded = ocp_v1.load_checkpointables(tmp_path / "c")
    assert loaded["config"] == CONFIG
    np.testing.assert_array_equal(loaded["state"]["w"], np.arange(3.0))
    assert ocp_v1.load_checkpointables(tmp_path / "c", {"config": None}) == {"config": CONFIG}


def test_the_typestrs_recorded_before_still_find_the_handlers() -> None:
    from checkpointables_json import JsonHandler
    from checkpointables_pytree import PyTreeHandler

    assert cp.handlers.get("checkpointables_json.JsonHandler") is JsonHandler
    assert cp.handlers.get("checkpointables_pytree._handler.PyTreeHandler") is PyTreeHandler


def test_we_load_orbax_json_checkpointables(tmp_path) -> None:
    registry = ocp_v1.handlers.local_registry()
    registry.add(ocp_v1.handlers.JsonHandler, checkpointable_name="config")
    context = ocp_v1.Context()
    context.checkpointables.registry = registry
    with context:
        ocp_v1.save_checkpointables(tmp_path / "c", {"state": {"w": np.ones(2)}, "config": CONFIG})
    assert (tmp_path / "c" / "config" / "data.json").exists()
    loaded = cp.load_checkpointables(tmp_path / "c")
    assert loaded["config"] == CONFIG and loaded["state"]["w"].tolist() == [1.0, 1.0]


def test_the_plugin_listing_shows_the_recorded_typestr(capsys) -> None:
    from checkpointables.cli import main as cli_main

    assert cli_main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert (
        "handler json: priority 60  checkpointables_json.JsonHandler (records "
        "orbax.checkpoint.experimental.v1._src.handlers.json_handler.JsonHandler)"
    ) in out
