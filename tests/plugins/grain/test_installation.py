"""The Grain plugin as installed: listed, lazy, and missed with a pip hint."""

from __future__ import annotations

import checkpointables as cp
from checkpointables import cli
from checkpointables.testing import missing_handler_message

from ...python_subprocess import run_python
from .pipelines import map_pipeline


def test_listed_ahead_of_the_stateful_handler(capsys) -> None:
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "grain  (checkpointables-grain 0.1.0)  [loaded]  checkpointables_grain" in out
    assert "handler grain: priority 10  checkpointables_grain.GrainIteratorHandler" in out
    order = [r.name for r in cp.handlers.registered_handlers()]
    assert order.index("grain") < order.index("stateful")


def test_missing_plugin_names_the_distribution_to_install(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "c", {"dataset": iter(map_pipeline())})
    message = missing_handler_message(tmp_path / "c", ["grain"])
    assert "checkpointables_grain.GrainIteratorHandler" in message
    assert "pip install checkpointables-grain" in message


def test_programs_without_grain_never_import_it(tmp_path) -> None:
    # Importing Grain takes seconds; the plugin must not cost that to others.
    result = run_python(
        f"""
        import sys
        import checkpointables as cp
        cp.save_checkpointables({str(tmp_path / "c")!r}, {{"x": {{"a": 1}}}})
        assert cp.load_checkpointables({str(tmp_path / "c")!r}) == {{"x": {{"a": 1}}}}
        assert "grain" in [p.name for p in cp.plugins.list_plugins() if p.status == "loaded"]
        print("GRAIN", sorted(m for m in sys.modules if m.split(".")[0] == "grain"))
        """
    )
    assert result.returncode == 0, result.stderr
    assert "GRAIN []" in result.stdout
