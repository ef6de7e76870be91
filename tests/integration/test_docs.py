"""The docs' Python examples run as written."""

from __future__ import annotations

import os
import re
from pathlib import Path

import checkpointables as cp
import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


def python_blocks(name: str) -> list[str]:
    """The ```python blocks of a docs page, in order."""
    return re.findall(r"```python\n(.*?)```", (DOCS / name).read_text(), flags=re.S)


def test_quickstart_runs(tmp_path, monkeypatch) -> None:
    try:
        cp.handlers.get("pytree")
    except cp.errors.MissingHandlerError:
        pytest.fail("the pytree plugin must be installed for the quickstart")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in python_blocks("quickstart.md"):
        exec(compile(block, "docs/quickstart.md", "exec"), namespace)
    assert cp.is_checkpoint(os.path.join(namespace["workdir"], "ckpt-30"))


def test_writing_a_plugin_runs(tmp_path, monkeypatch) -> None:
    import sys
    import types

    blocks = python_blocks("writing-a-plugin.md")
    module = types.ModuleType("point_plugin_doc")
    monkeypatch.setitem(sys.modules, module.__name__, module)  # dataclasses look it up
    namespace = module.__dict__
    for block in blocks:
        exec(compile(block, "docs/writing-a-plugin.md", "exec"), namespace)
    try:
        point = namespace["Point"](1.0, 2.0)
        cp.save_checkpointables(tmp_path / "c", {"p": point})
        assert cp.load_checkpointables(tmp_path / "c") == {"p": point}
        # The conformance class from the page passes against the page's handler.
        suite = namespace["TestPointHandler"]()
        for test in [n for n in dir(suite) if n.startswith("test_")]:
            target = tmp_path / test
            target.mkdir()
            method = getattr(suite, test)
            if "tmp_path" in method.__code__.co_varnames:
                method(target)
            else:
                method()
    finally:
        cp.handlers.unregister_handler(namespace["PointHandler"])


def test_integrity_runs(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in python_blocks("integrity.md"):
        exec(compile(block, "docs/integrity.md", "exec"), namespace)
    assert cp.metadata_checksums.is_protected(tmp_path / "ckpt")
