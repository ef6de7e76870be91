"""Failure modes of real entry points, in subprocesses whose environment differs.

A throwaway distribution (a ``.dist-info`` with ``entry_points.txt``) is put on
``PYTHONPATH``, so importlib-metadata discovers it exactly as an installed package.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def _install_fake_distribution(root, name: str, module_source: str) -> dict[str, str]:
    module = name.replace("-", "_")
    (root / f"{module}.py").write_text(textwrap.dedent(module_source))
    info = root / f"{module}-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(f"[checkpointables]\n{name} = {module}\n")
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "checkpointables", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_broken_plugin_warns_and_is_listed_with_its_error(tmp_path) -> None:
    env = _install_fake_distribution(
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
    env = _install_fake_distribution(
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
