"""A real third-party plugin package, installed in the dev environment, found by entry point.

`checkpointables_example_point` is never imported here before saving: the
entry point brings in its handlers.
"""

from __future__ import annotations

import json
import re

import checkpointables as cp
import pytest
from checkpointables import cli
from checkpointables.testing import HandlerConformance, missing_handler_message

from ..python_subprocess import run_python


def test_plugin_is_found_without_importing_it(tmp_path) -> None:
    code = f"""
import sys, checkpointables as cp
assert "checkpointables_example_point" not in sys.modules
handler = cp.handlers.get("example-point")
Point = sys.modules[handler.__module__].Point
cp.save_checkpointables({str(tmp_path / "c")!r}, {{"p": Point(1, 2.5)}})
print(cp.load_checkpointables({str(tmp_path / "c")!r}))
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "Point(x=1, y=2.5)" in result.stdout


def test_missing_plugin_at_load_is_a_clear_error(tmp_path) -> None:
    save = f"""
import checkpointables as cp
from checkpointables_example_point import Point
cp.save_checkpointables({str(tmp_path / "c")!r}, {{"p": Point(1, 2)}})
"""
    assert run_python(save).returncode == 0
    message = missing_handler_message(tmp_path / "c", ["example-point"])
    assert "checkpointables_example_point.PointHandler" in message
    assert "is not registered here" in message


def test_missing_json_plugin_names_distribution(tmp_path) -> None:
    import checkpointables as cp

    cp.save_checkpointables(tmp_path / "c", {"extra": {"a": 1}})
    message = missing_handler_message(tmp_path / "c", ["json", "pytree"])
    assert "pip install checkpointables-json" in message


def test_missing_third_party_plugin_names_the_recorded_distribution(tmp_path) -> None:
    from checkpointables_example_point import Point

    cp.save_checkpointables(tmp_path / "c", {"p": Point(1, 2), "other": {"a": 1}})
    meta = json.loads((tmp_path / "c" / "_CHECKPOINT_METADATA").read_text())
    recorded = meta["custom_metadata"]["checkpointables_handler_distributions"]
    assert recorded["p"] == {"distribution": "checkpointables-example-point", "version": "0.1.0"}
    assert recorded["other"]["distribution"] == "checkpointables-json"
    assert cp.load_checkpointables(tmp_path / "c")["other"] == {"a": 1}
    assert cp.checkpointables_metadata(tmp_path / "c").custom_metadata == {}  # Not leaked there.
    message = missing_handler_message(tmp_path / "c", ["example-point"])
    assert "checkpointables_example_point.PointHandler" in message
    assert "pip install 'checkpointables-example-point==0.1.0'" in message


@pytest.mark.parametrize(
    ("save", "disabled", "plugin"),
    [
        (
            '{"p": __import__("checkpointables_example_point").Point(1, 2)}',
            "example-point",
            "example-point",
        ),
        ('{"extra": {"a": 1}}', "json,pytree", "json"),
        ('{"dataset": iter(__import__("grain").MapDataset.range(4))}', "grain", "grain"),
    ],
    ids=["third-party", "json", "grain"],
)
def test_disabled_plugin_is_named_as_disabled_not_to_install(
    tmp_path, save, disabled, plugin
) -> None:
    path = str(tmp_path / "c")
    saved = run_python(f"import checkpointables as cp; cp.save_checkpointables({path!r}, {save})")
    assert saved.returncode == 0, saved.stderr
    code = f"""
import checkpointables as cp
try:
    cp.load_checkpointables({path!r})
except cp.errors.MissingHandlerError as e:
    print(e)
"""
    message = run_python(code, CHECKPOINTABLES_DISABLE_PLUGINS=disabled).stdout
    assert f"plugin {plugin!r}" in message
    assert "disabled by CHECKPOINTABLES_DISABLE_PLUGINS" in message
    assert "pip install" not in message


def test_orbax_loads_checkpoints_that_record_distributions(tmp_path) -> None:
    import numpy as np
    import orbax.checkpoint as ocp
    from orbax.checkpoint import v1 as ocp_v1

    tree = {"w": np.arange(6.0).reshape(2, 3), "step": 3}
    # Orbax refuses an unknown top-level field when custom_metadata is not empty.
    cp.save_checkpointables(
        tmp_path / "c", {"pytree": tree, "extra": {"a": 1}}, custom_metadata={"run": "r1"}
    )
    cp.save_pytree(tmp_path / "p", tree)
    for path in (tmp_path / "c", tmp_path / "p"):
        meta = json.loads((path / "_CHECKPOINT_METADATA").read_text())
        assert "checkpointables_handler_distributions" in meta["custom_metadata"]
    assert cp.checkpointables_metadata(tmp_path / "c").custom_metadata == {"run": "r1"}
    assert ocp_v1.checkpointables_metadata(tmp_path / "c").custom_metadata["run"] == "r1"
    loaded = ocp_v1.load_checkpointables(tmp_path / "c")
    assert loaded["extra"] == {"a": 1}
    np.testing.assert_array_equal(loaded["pytree"]["w"], tree["w"])
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "p" / "pytree")
    np.testing.assert_array_equal(restored["w"], tree["w"])


class TestExamplePointConformance(HandlerConformance):
    """The conformance suite, run against the third-party handler as its author would."""

    handler_name = "example-point"

    def make_checkpointables(self):
        from checkpointables_example_point import Point

        return [Point(1, 2), Point(3.5, -1)]

    def make_unhandleable(self):
        return [{"x": 1, "y": 2}, "point"]

    def abstract_for(self, checkpointable):
        from checkpointables_example_point import AbstractPoint

        return AbstractPoint.from_point(checkpointable)

    def assert_metadata_matches(self, metadata, original):
        from checkpointables_example_point import AbstractPoint

        assert metadata == AbstractPoint.from_point(original)


def test_plugin_command_is_listed_and_runs(tmp_path) -> None:
    from checkpointables_example_point import Point

    cp.save_checkpointables(tmp_path / "c", {"p": Point(1, 2.5), "other": {"a": 1}})
    assert "points" in cli.build_parser().format_help()
    result = run_python(
        "import sys; from checkpointables import cli; sys.exit(cli.main(sys.argv[1:]))",
        "points",
        str(tmp_path / "c"),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "p: (1, 2.5)\n"


def test_plugin_command_is_absent_without_the_plugin() -> None:
    code = "import sys; from checkpointables import cli; sys.exit(cli.main(['--help']))"
    installed = run_python(code)
    disabled = run_python(code, CHECKPOINTABLES_DISABLE_PLUGINS="example-point")
    assert installed.returncode == disabled.returncode == 0
    listed = re.compile(r"^\s+points\s+print the Points", re.M)
    assert listed.search(installed.stdout)
    assert not listed.search(disabled.stdout)
    assert ",points}" not in disabled.stdout


def test_plugins_listing_shows_reader_and_command(capsys) -> None:
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "pytree reader pointfile: priority 50" in out
    assert "command points: print the Points saved in a checkpoint" in out


def test_pytree_reader_loads_a_file_that_is_not_a_checkpoint(tmp_path) -> None:
    path = tmp_path / "a.point.json"
    path.write_text('{"x": 1, "y": 2.5}')
    assert not cp.is_checkpoint(path)
    assert cp.load_pytree(path) == {"x": 1, "y": 2.5}
    assert cp.load_pytree_async(str(path)).result() == {"x": 1, "y": 2.5}
    meta = cp.pytree_metadata(path)
    assert meta.metadata == {"x": int, "y": float}
    assert cp.load_pytree(path, {"x": float, "y": int}) == {"x": 1.0, "y": 2}
    with pytest.raises(ValueError, match="drop checkpointable_name='pytree'"):
        cp.load_pytree(path, checkpointable_name="pytree")


def test_checkpoints_are_never_given_to_readers(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", {"x": 3})
    assert cp.readers.reader_for(tmp_path / "c") is None
    assert type(cp.readers.reader_for(tmp_path / "x.point.json")) is type(None)
    (tmp_path / "x.point.json").write_text("{}")
    assert type(cp.readers.reader_for(tmp_path / "x.point.json")).__name__ == "PointFileReader"
    # Unrecognized paths still get the checkpoint errors.
    with pytest.raises(FileNotFoundError):
        cp.load_pytree(tmp_path / "missing")
    (tmp_path / "x.other").write_text("{}")
    with pytest.raises(cp.errors.NotACheckpointError):
        cp.load_pytree(tmp_path / "x.other")


def test_a_leaf_of_a_disabled_plugin_names_the_plugin(tmp_path) -> None:
    # A pytree leaf (not a whole item) saved by the example plugin's leaf handler.
    path = str(tmp_path / "c")
    saved = run_python(
        "import checkpointables as cp, numpy as np\n"
        "from checkpointables_example_point import Point\n"
        f"cp.save_pytree({path!r}, {{'p': Point(1, 2), 'w': np.ones(3)}})"
    )
    assert saved.returncode == 0, saved.stderr
    code = f"""
import checkpointables as cp
try:
    cp.load_pytree({path!r})
except cp.errors.MissingHandlerError as e:
    print(e)
"""
    message = run_python(code, CHECKPOINTABLES_DISABLE_PLUGINS="example-point").stdout
    assert "['p']" in message and "plugin 'example-point'" in message, message
    assert "disabled by CHECKPOINTABLES_DISABLE_PLUGINS" in message
