"""What users see names the handler class that runs, not the typestr it records (which,
for the JSON and pytree handlers, is Orbax's class name so that Orbax reads our
checkpoints); ``checkpointables plugins`` shows the typestr apart."""

from __future__ import annotations

from pathlib import Path

import checkpointables as cp
import pytest
from checkpointables import cli

_ORBAX_JSON = "orbax.checkpoint.experimental.v1._src.handlers.json_handler.JsonHandler"


def test_plugins_shows_the_json_class_and_its_typestrs_apart(capsys) -> None:
    assert cli.main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index(
        f"    handler json: priority 60  checkpointables_json.JsonHandler (records {_ORBAX_JSON})"
    )
    assert lines[at + 1].startswith("      also reads checkpoints recording: ")
    assert "orbax.checkpoint._src.handlers.json_checkpoint_handler." in lines[at + 1]


def test_a_save_error_names_the_classes_tried(tmp_path: Path) -> None:
    with pytest.raises(cp.errors.NoHandlerForObjectError) as raised:
        cp.save_checkpointables(tmp_path / "c", {"a": object()})
    message = str(raised.value)
    assert "json (checkpointables_json.JsonHandler)" in message
    assert "orbax.checkpoint" not in message
