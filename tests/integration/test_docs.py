"""The docs' Python examples run as written."""

from __future__ import annotations

import os
import re
from pathlib import Path

import checkpointables as cp
import jax
import pytest

from ..metadata_edits import with_metadata_checksums_recomputed

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
        _check_refuses_damage(namespace, tmp_path)
        _check_command_and_reader(namespace, tmp_path)
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
        _check_capabilities(namespace, tmp_path)
    finally:
        cp.handlers.unregister_handler(namespace["PointHandler"])


def _check_refuses_damage(namespace: dict, tmp_path) -> None:
    """The page's PointHandler reads through the checksum check: an edited file is refused."""
    path = tmp_path / "damaged"
    cp.save_checkpointables(path, {"p": namespace["Point"](1.0, 2.0)})
    (path / "p" / "point.json").write_text('{"x": 9.0, "y": 2.0}')
    for load in (cp.load_checkpointables, cp.checkpointables_metadata):
        with pytest.raises(cp.errors.IntegrityError, match=r"point\.json"):
            load(path)


def _check_capabilities(namespace: dict, tmp_path) -> None:
    """The page's handlers with optional capabilities work through the library."""
    import asyncio

    from checkpointables import cli

    point = namespace["Point"](1.0, 2.0)
    for handler in (namespace["CheckedPointHandler"], namespace["CarefulPointHandler"]):
        cp.handlers.register_handler(handler, priority=10)  # Ahead of the page's PointHandler.
        try:
            path = tmp_path / handler.__name__
            cp.save_checkpointables(path, {"p": point})
            assert cp.load_checkpointables(path) == {"p": point}
            assert cp.checkpointables_metadata(path).metadata["p"] == namespace["AbstractPoint"]()
            assert cli.main(["verify", str(path)]) == 0
        finally:
            cp.handlers.unregister_handler(handler)
    damaged = tmp_path / "CheckedPointHandler" / "p"
    (damaged / "point.json").write_text('{"x": "one", "y": 2.0}')
    problems = asyncio.run(namespace["CheckedPointHandler"]().verify(damaged))
    assert len(problems) == 1 and "point.json is unreadable" in problems[0], problems
    assert "checksum" in problems[0], problems  # The edit is caught by its checksum first...
    with_metadata_checksums_recomputed(damaged.parent)  # ... made on purpose, by the values.
    problems = asyncio.run(namespace["CheckedPointHandler"]().verify(damaged))
    assert problems == [f"{damaged / 'point.json'}: x is not a number"]


def _check_command_and_reader(namespace: dict, tmp_path) -> None:
    """The page's command and reader do what it says, through the page's hook functions."""
    import argparse
    import asyncio
    import contextlib
    import io

    from etils import epath

    commands, readers = [], []
    namespace["register_commands"](lambda *a, **k: commands.append((a, k)))
    namespace["register_pytree_readers"](lambda *a, **k: readers.append((a, k)))
    (name, run), options = commands[0]
    parser = argparse.ArgumentParser()
    options["add_arguments"](parser)
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        assert run(parser.parse_args([str(tmp_path / "c")])) == 0
    assert (name, output.getvalue()) == ("show-points", "p: (1.0, 2.0)\n")
    reader = readers[0][0][0]()
    (tmp_path / "a.point.json").write_text('{"x": 1, "y": 2.5}')
    path = epath.Path(tmp_path / "a.point.json")
    assert reader.recognizes(path) and not reader.recognizes(epath.Path(tmp_path / "c"))
    loaded = asyncio.run(_twice(reader.load(path)))
    assert loaded == {"x": 1, "y": 2.5}


async def _twice(awaitable):
    return await (await awaitable)


@pytest.mark.slow  # Compiles a few training steps of three libraries.
def test_recipes_run(tmp_path, monkeypatch) -> None:
    import sys
    import types

    monkeypatch.chdir(tmp_path)
    module = types.ModuleType("recipes_doc")
    monkeypatch.setitem(sys.modules, module.__name__, module)  # dataclasses look it up
    namespace = module.__dict__
    blocks = python_blocks("recipes.md")
    assert len(blocks) >= 12
    for block in blocks:
        exec(compile(block, "docs/recipes.md", "exec"), namespace)
    # The last restore (Equinox, parameters only) gave back the saved arrays.
    saved = jax.tree.leaves(namespace["params"])
    restored = jax.tree.leaves(namespace["loaded"]["model"])
    assert len(saved) == len(restored) == 6
    assert all(bool((a == b).all()) for a, b in zip(saved, restored, strict=True))


def test_integrity_runs(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in python_blocks("integrity.md"):
        exec(compile(block, "docs/integrity.md", "exec"), namespace)
    assert cp.metadata_checksums.is_protected(tmp_path / "ckpt")
