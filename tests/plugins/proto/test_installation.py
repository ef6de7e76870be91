"""The proto plugin as installed: listed, lazy, and missed with a pip hint."""

from __future__ import annotations

import checkpointables as cp
from checkpointables import cli
from checkpointables.testing import missing_handler_message
from google.protobuf import duration_pb2

from ...python_subprocess import run_python


def test_listed_by_the_plugins_command(capsys) -> None:
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "proto  (checkpointables-proto 0.1.0)  [loaded]  checkpointables_proto" in out
    assert "handler proto: priority 30  checkpointables_proto.ProtoHandler" in out


def test_missing_plugin_names_the_distribution_to_install(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "c", {"config": duration_pb2.Duration(seconds=1)})
    message = missing_handler_message(tmp_path / "c", ["proto"])
    assert "checkpointables_proto.ProtoHandler" in message
    assert "pip install checkpointables-proto" in message


def test_programs_without_protobuf_never_import_it(tmp_path) -> None:
    result = run_python(
        f"""
        import sys
        import checkpointables as cp
        cp.save_checkpointables({str(tmp_path / "c")!r}, {{"x": {{"a": 1}}}})
        assert cp.load_checkpointables({str(tmp_path / "c")!r}) == {{"x": {{"a": 1}}}}
        assert "proto" in [p.name for p in cp.plugins.list_plugins() if p.status == "loaded"]
        print("PROTOBUF", sorted(m for m in sys.modules if m.startswith("google.protobuf")))
        """
    )
    assert result.returncode == 0, result.stderr
    assert "PROTOBUF []" in result.stdout
