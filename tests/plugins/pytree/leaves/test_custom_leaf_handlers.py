"""Custom leaf handlers: the custom-handlers guide's PointLeafHandler, and the plugin hook.

The guide's section "Custom Leaf Handler" runs here as written, with ``cp.``
for ``ocp.`` and two notebook-isms adapted: ``multihost.is_primary_host(0)``
becomes ``cp.multihost.is_primary_host()`` and ``getattr(__builtins__, v)``
becomes ``getattr(builtins, v)`` (in a module ``__builtins__`` is a dict).
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import re
from collections.abc import Awaitable, Sequence
from pathlib import Path

import aiofiles
import checkpointables as cp
import numpy as np
import pytest
from checkpointables import serialization
from checkpointables.checkpoint_metadata import read_checkpoint_metadata


@dataclasses.dataclass
class Point:
    x: int | float
    y: int | float


@dataclasses.dataclass
class AbstractPoint:
    x: type[int | float]
    y: type[int | float]

    @classmethod
    def from_point(cls, point):
        return cls(x=type(point.x), y=type(point.y))


class PointLeafHandler(serialization.LeafHandler[Point, AbstractPoint]):
    """A custom leaf handler for testing."""

    def __init__(self, context: cp.Context | None = None):
        del context

    async def serialize(
        self,
        params: Sequence[serialization.SerializationParam[Point]],
        serialization_context: serialization.SerializationContext,
    ) -> Awaitable[None]:
        async def _background_serialize(params, serialization_context):
            await serialization_context.parent_dir.await_creation()
            if cp.multihost.is_primary_host():
                for param in params:
                    async with aiofiles.open(
                        serialization_context.parent_dir.path / f"{param.name}.txt", "w"
                    ) as f:
                        await f.write(json.dumps(dataclasses.asdict(param.value)))
                    async with aiofiles.open(
                        serialization_context.parent_dir.path / f"{param.name}.metadata.txt", "w"
                    ) as abstract_f:
                        contents = json.dumps(
                            {
                                k: type(v).__name__
                                for k, v in dataclasses.asdict(param.value).items()
                            }
                        )
                        await abstract_f.write(contents)

        return _background_serialize(params, serialization_context)

    async def deserialize(
        self,
        params: Sequence[serialization.DeserializationParam[AbstractPoint]],
        deserialization_context: serialization.DeserializationContext,
    ) -> Awaitable[Sequence[Point]]:
        async def _deserialize_impl():
            ret = []
            for param in params:
                async with aiofiles.open(
                    deserialization_context.parent_dir / f"{param.name}.txt"
                ) as f:
                    ret.append(Point(**json.loads(await f.read())))
            return ret

        return _deserialize_impl()

    async def metadata(
        self,
        params: Sequence[serialization.DeserializationParam[None]],
        deserialization_context: serialization.DeserializationContext,
    ) -> Sequence[AbstractPoint]:
        ret = []
        for param in params:
            async with aiofiles.open(
                deserialization_context.parent_dir / f"{param.name}.metadata.txt"
            ) as f:
                contents = json.loads(await f.read())
                ret.append(AbstractPoint(**{k: getattr(builtins, v) for k, v in contents.items()}))
        return ret


def _train_state():
    return {
        "a": np.arange(16),
        "b": np.ones(16),
        "scalar": 123.0,
        "mixed": {"a": np.arange(16), "b": np.ones(16), "scalar": 123.0, "Point": Point(0, 0.5)},
        "Points": {
            "level1": {
                "point_int": Point(1, 2),
                "point_float": Point(3.0, 4.0),
                "level2": {
                    "point_mixed1": Point(5, 6.0),
                    "point_mixed2": Point(7.0, 8),
                    "point_int": Point(9, 10),
                    "point_float": Point(11.0, 12.0),
                },
            }
        },
    }


def _assert_equal_trees(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_equal_trees(a[k], b[k])
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b and type(a.x if isinstance(a, Point) else a) is type(
            b.x if isinstance(b, Point) else b
        )


def test_the_guide_point_leaf_handler(tmp_path) -> None:
    registry = serialization.StandardLeafHandlerRegistry()
    registry.add(Point, AbstractPoint, PointLeafHandler)
    path = tmp_path / "with_points"
    train_state = _train_state()
    with cp.Context(pytree_options=cp.options.PyTreeOptions(leaf_handler_registry=registry)):
        cp.save_pytree(path, train_state)
    with cp.Context(pytree_options=cp.options.PyTreeOptions(leaf_handler_registry=registry)):
        restored_train_state = cp.load_pytree(path)
    _assert_equal_trees(restored_train_state, train_state)
    with cp.Context(pytree_options=cp.options.PyTreeOptions(leaf_handler_registry=registry)):
        restored_metadata = cp.pytree_metadata(path)
    points = restored_metadata.metadata["Points"]["level1"]
    assert points["point_int"] == AbstractPoint(int, int)
    assert points["level2"]["point_mixed1"] == AbstractPoint(int, float)
    assert restored_metadata.metadata["mixed"]["Point"] == AbstractPoint(int, float)
    # The point files sit next to the arrays, named by each leaf's storage name.
    assert (path / "pytree" / "Points.level1.level2.point_int.txt").exists()


def test_custom_leaves_need_their_handler_to_load(tmp_path) -> None:
    registry = serialization.StandardLeafHandlerRegistry()
    registry.add(Point, AbstractPoint, PointLeafHandler)
    with cp.Context(pytree_options=cp.options.PyTreeOptions(leaf_handler_registry=registry)):
        cp.save_pytree(tmp_path / "c", {"p": Point(1, 2), "a": np.ones(2)})
    # Without the handler: an error naming the value type and the leaf, or skip it.
    try:
        cp.load_pytree(tmp_path / "c")
    except cp.errors.MissingHandlerError as e:
        assert "PointLeafHandler" in str(e) and "['p']" in str(e)
    else:
        raise AssertionError("loading a custom leaf without its handler must fail")
    loaded = cp.load_pytree(tmp_path / "c", {"p": cp.PLACEHOLDER, "a": np.empty(2)})
    assert loaded["p"] is cp.PLACEHOLDER


def test_a_plugins_leaf_handler_works_without_any_setup(tmp_path) -> None:
    # The example plugin (a real installed distribution) registers its Point leaf
    # handler through the register_leaf_handlers hook.
    from checkpointables_example_point import AbstractPoint as PluginAbstractPoint
    from checkpointables_example_point import Point as PluginPoint

    tree = {"p": PluginPoint(1, 2.5), "a": np.arange(3)}
    cp.save_pytree(tmp_path / "c", tree)
    assert read_checkpoint_metadata(tmp_path / "c")["item_handlers"]["pytree"].endswith(
        "PyTreeHandler"
    )
    loaded = cp.load_pytree(tmp_path / "c")
    assert loaded["p"] == PluginPoint(1, 2.5)
    assert cp.pytree_metadata(tmp_path / "c").metadata["p"] == PluginAbstractPoint(int, float)
    cast = cp.load_pytree(tmp_path / "c", {"p": PluginAbstractPoint(float, int), "a": np.empty(3)})
    assert cast["p"] == PluginPoint(1.0, 2) and type(cast["p"].x) is float


def _doc_leaf_handler() -> dict:
    """docs/pytree.md's Point, AbstractPoint and PointLeafHandler, as the page defines them."""
    page = Path(__file__).resolve().parents[4] / "docs" / "pytree.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    (block,) = [b for b in blocks if "class PointLeafHandler" in b]
    namespace: dict = {"__name__": "docs_pytree_leaves"}
    exec(compile(block, str(page), "exec", dont_inherit=True), namespace)
    return namespace


def _doc_registry(doc: dict) -> cp.Context:
    registry = serialization.StandardLeafHandlerRegistry()
    registry.add(doc["Point"], doc["AbstractPoint"], doc["PointLeafHandler"])
    return cp.Context(pytree_options=cp.options.PyTreeOptions(leaf_handler_registry=registry))


def test_the_doc_leaf_handler_refuses_a_damaged_file(tmp_path) -> None:
    doc = _doc_leaf_handler()
    with _doc_registry(doc):
        cp.save_pytree(tmp_path / "c", {"origin": doc["Point"](0.0, 0.0), "w": np.ones(3)})
        assert cp.load_pytree(tmp_path / "c")["origin"] == doc["Point"](0.0, 0.0)
        (tmp_path / "c" / "pytree" / "origin.point.json").write_text('{"x": 5.0, "y": 0.0}')
        with pytest.raises(cp.errors.IntegrityError, match=r"origin\.point\.json"):
            cp.load_pytree(tmp_path / "c")


def test_an_abstract_leaf_for_another_leaf_handler_is_a_tree_mismatch(tmp_path) -> None:
    doc = _doc_leaf_handler()
    with _doc_registry(doc):
        cp.save_pytree(tmp_path / "c", {"p": doc["Point"](1.0, 2.0), "w": np.ones(3)})
        with pytest.raises(cp.errors.TreeMismatchError) as raised:
            cp.load_pytree(tmp_path / "c", {"p": np.empty(3), "w": doc["AbstractPoint"]()})
    message = str(raised.value)
    assert (
        "['w'] (saved as np.ndarray; the abstract leaf, a docs_pytree_leaves.AbstractPoint, asks "
        "for the leaf handler docs_pytree_leaves.PointLeafHandler, which does not read "
        "np.ndarray)" in message
    ), message
    assert "['p'] (saved by the leaf handler docs_pytree_leaves.PointLeafHandler; " in message
    assert str(tmp_path / "c" / "pytree") in message


def test_a_leaf_handler_that_declares_the_saved_type_reads_it(tmp_path) -> None:
    doc = _doc_leaf_handler()
    saved_by = cp.handlers.typestr(doc["PointLeafHandler"])

    class AbstractPointV2(doc["AbstractPoint"]):
        pass

    class PointV2LeafHandler(doc["PointLeafHandler"]):
        """Reads what PointLeafHandler wrote, as it declares."""

    with _doc_registry(doc):
        cp.save_pytree(tmp_path / "c", {"p": doc["Point"](1.0, 2.0)})
    registry = serialization.StandardLeafHandlerRegistry()
    v2 = cp.handlers.typestr(PointV2LeafHandler)
    registry.add(doc["Point"], AbstractPointV2, PointV2LeafHandler, secondary_typestrs=(v2,))
    options = cp.options.PyTreeOptions(leaf_handler_registry=registry)
    with cp.Context(pytree_options=options), pytest.raises(cp.errors.TreeMismatchError):
        cp.load_pytree(tmp_path / "c", {"p": AbstractPointV2()})  # Not declared: refused.
    registry.add(
        doc["Point"],
        AbstractPointV2,
        PointV2LeafHandler,
        secondary_typestrs=(v2, saved_by),
        override=True,
    )
    with cp.Context(pytree_options=options):
        assert cp.load_pytree(tmp_path / "c", {"p": AbstractPointV2()}) == {
            "p": doc["Point"](1.0, 2.0)
        }
