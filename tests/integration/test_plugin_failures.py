"""Failure modes of real entry points, in subprocesses whose environment differs.

A throwaway distribution (a ``.dist-info`` with ``entry_points.txt``) is put on
``PYTHONPATH``, so importlib-metadata discovers it exactly as an installed package.
"""

from __future__ import annotations

import os
import subprocess
import sys

from ..python_subprocess import install_fake_distribution


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "checkpointables", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_broken_plugin_warns_and_is_listed_with_its_error(tmp_path) -> None:
    env = install_fake_distribution(
        tmp_path, "broken-plugin", "raise ImportError('needs libfoo 9')\n"
    )
    result = _cli("plugins", env=env)
    assert result.returncode == 0, result.stderr
    assert "broken-plugin  (broken-plugin 0.3)  [failed]" in result.stdout
    assert "needs libfoo 9" in result.stdout
    assert "RuntimeWarning" in result.stderr and "broken-plugin" in result.stderr
    # The other plugins keep working.
    assert "handler json" in result.stdout
    save = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore::RuntimeWarning",
            "-c",
            "import checkpointables as cp, sys;"
            "cp.save_checkpointables(sys.argv[1], {'e': {'a': 1}})",
            str(tmp_path / "c"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert save.returncode == 0, save.stderr
    assert (tmp_path / "c" / "e" / "data.json").exists()


def test_disable_env_var_blocks_by_entry_point_name(tmp_path) -> None:
    env = install_fake_distribution(
        tmp_path, "broken-plugin", "raise ImportError('needs libfoo 9')\n"
    )
    env["CHECKPOINTABLES_DISABLE_PLUGINS"] = "broken-plugin, json"
    result = _cli("plugins", env=env)
    assert result.returncode == 0, result.stderr
    assert "RuntimeWarning" not in result.stderr
    assert "broken-plugin  (broken-plugin 0.3)  [disabled]" in result.stdout
    assert "json  (checkpointables-json" in result.stdout and "handler json" not in result.stdout


def test_plugins_command_shows_resolution_order() -> None:
    result = _cli("plugins", env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    order = result.stdout.split("Save resolution order")[1]
    assert order.index("stateful") < order.index("json")


_CLAIMS_JSON = """
    import checkpointables as cp

    class ZHandler:
        async def save(self, directory, checkpointable): ...
        async def load(self, directory, abstract_checkpointable=None): return "evil"
        async def metadata(self, directory): ...
        def is_handleable(self, obj): return False
        def is_abstract_handleable(self, abstract): return None

    @cp.hookimpl
    def register_checkpointable_handlers(register):
        register(ZHandler, priority=55, name="zhandler",
                 typestr="orbax.checkpoint.experimental.v1._src.handlers.json_handler.JsonHandler")
"""

_LOAD_AND_LIST = """
import sys, checkpointables as cp
from checkpointables import cli
try:
    print("value:", cp.load_checkpointables(sys.argv[1]))
except cp.errors.PluginError as e:
    print("refused:", e)
cli.main(["inspect", sys.argv[1]])
cli.main(["plugins"])
"""


def test_a_plugin_claiming_another_plugins_typestr_reads_nothing_of_it(tmp_path) -> None:
    """A second plugin registering the JSON plugin's typestr must not read JSON checkpoints:
    the load refuses, ``inspect`` and ``plugins`` show the clash, discovery warns."""
    import checkpointables as cp

    cp.save_checkpointables(tmp_path / "ck", {"e": {"a": 1}})
    env = install_fake_distribution(tmp_path, "evil", _CLAIMS_JSON)
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_LIST, str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "value:" not in done.stdout and "refused:" in done.stdout
    assert "claimed by plugins 'evil' and 'json'" in done.stdout  # inspect
    assert "Typestr clashes" in done.stdout and "handler 'zhandler'" in done.stdout  # plugins
    assert "RuntimeWarning" in done.stderr and "plugin 'evil'" in done.stderr
