"""A real third-party plugin package, installed in the dev environment, found by entry point.

`checkpointables_example_point` is never imported here before saving: the
entry point brings in its handlers.
"""

from __future__ import annotations

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
