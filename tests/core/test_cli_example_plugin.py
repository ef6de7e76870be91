"""The tests' example plugin, which the dev dependency group installs, says what it is
wherever the command line lists it."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkpointables import cli, plugins

MARK = "(the tests' example plugin; see docs/writing-a-plugin.md)"
DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(autouse=True)
def _needs_the_example_plugin() -> None:
    if "example-point" not in {info.name for info in plugins.list_plugins()}:
        pytest.skip("needs tests/example_plugin installed (the default dev group)")


def test_help_marks_the_points_command_as_the_tests_example(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help.
    assert f"points print the Points saved in a checkpoint {MARK}" in text
    assert (DOCS / "writing-a-plugin.md").is_file()


def test_plugins_marks_the_example_plugin(capsys) -> None:
    assert cli.main(["plugins"]) == 0
    assert (
        f"command points: print the Points saved in a checkpoint {MARK}" in capsys.readouterr().out
    )
