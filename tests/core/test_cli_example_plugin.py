"""The tests' example plugin, which the dev dependency group installs, says what it is
wherever the command line lists it, and outside the test suite (which switches it on)
registers nothing: a newcomer's command line in a fresh checkout shows no test plugin."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
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


_OUTSIDE_THE_SUITE = textwrap.dedent(
    """
    import contextlib, io
    import checkpointables as cp
    from checkpointables import cli
    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
        cli.main(["--help"])
    print("HELP", " ".join(help_text.getvalue().split()))
    print("ORDER", [h.name for h in cp.handlers.registered_handlers()])
    cli.main(["plugins"])
    """
)


def test_outside_the_test_suite_the_example_plugin_registers_nothing() -> None:
    env = {k: v for k, v in os.environ.items() if k != "CHECKPOINTABLES_EXAMPLE_PLUGIN"}
    result = subprocess.run(
        [sys.executable, "-c", _OUTSIDE_THE_SUITE],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    help_line = next(line for line in out.splitlines() if line.startswith("HELP"))
    assert "{plugins,inspect,verify,demo,export,import}" in help_line
    assert "Points" not in help_line
    order = next(line for line in out.splitlines() if line.startswith("ORDER"))
    assert "example-point" not in order and "'json'" in order
    # Still listed as installed, saying why it registers nothing.
    assert "example-point  (checkpointables-example-point " in out
    assert "[installed, inactive]  checkpointables_example_point\n    registers nothing" in out
    assert "handler example-point" not in out
