"""A pytree leaf that no leaf handler accepts but a checkpointable handler saves (a Grain
iterator, an object with save/load methods): the error names that handler and its plugin,
and shows the ``save_checkpointables`` call that saves it beside the pytree, a call that works."""

from __future__ import annotations

import re

import checkpointables as cp
import grain
import numpy as np
import pytest


def _iterator():
    return iter(grain.MapDataset.range(10).batch(2))


class _Opaque:
    """No leaf handler and no checkpointable handler accepts it."""


GRAIN = (
    "['it'] is an object that the 'grain' handler (checkpointables_grain.GrainIteratorHandler, "
    "plugin 'grain') saves, though not inside a pytree: save it as a checkpointable of its "
    "own, beside the pytree: cp.save_checkpointables(path, {'pytree': <the tree without "
    "['it']>, 'it': <the object at ['it']>})"
)


def test_save_pytree_names_the_grain_handler_and_the_call(tmp_path) -> None:
    it = _iterator()
    tree = {"params": {"w": np.ones(2)}, "it": it}
    with pytest.raises(cp.errors.NoHandlerForObjectError) as e:
        cp.save_pytree(tmp_path / "p", tree)
    message = str(e.value)
    assert GRAIN in message
    # The old advice that fails the same way is gone for a tree.
    assert "save_checkpointables({'pytree': obj})" not in message
    with pytest.raises(cp.errors.NoHandlerForObjectError) as e:
        cp.save_checkpointables(tmp_path / "p", {"pytree": tree})
    assert GRAIN in str(e.value)
    assert not (tmp_path / "p").exists()
    # The call shown works, and the iterator resumes where it was.
    next(it)
    cp.save_checkpointables(tmp_path / "p", {"pytree": {"params": tree["params"]}, "it": it})
    fresh = _iterator()
    restored = cp.load_checkpointables(tmp_path / "p", {"pytree": None, "it": fresh})
    np.testing.assert_array_equal(restored["pytree"]["params"]["w"], np.ones(2))
    np.testing.assert_array_equal(next(restored["it"]), [2, 3])


class _Stateful:
    """Saved by the core's stateful handler (save/load methods)."""

    async def save(self, directory):
        return None

    async def load(self, directory):
        return None


def test_several_leaves_each_named_with_a_free_checkpointable_name(tmp_path) -> None:
    tree = {
        "a": {"it": _iterator()},
        "b": {"it": _iterator(), "x": _Opaque()},
        "pytree": _Stateful(),
        "w": np.ones(1),
    }
    with pytest.raises(cp.errors.NoHandlerForObjectError) as e:
        cp.save_pytree(tmp_path / "p", tree)
    message = str(e.value)
    assert "Some are objects that checkpointable handlers save, though not inside a pytree" in (
        message
    )
    assert "['a']['it'] by the 'grain' handler" in message
    assert "['pytree'] by the 'stateful' handler" in message
    assert "_Opaque" in message and "['b']['x'] by" not in message  # No handler saves it.
    call = re.search(r"cp\.save_checkpointables\(path, \{.*?\}\)", message)
    assert call is not None
    assert call.group(0) == (
        "cp.save_checkpointables(path, {'pytree': <the tree without ['a']['it'], ['b']['it'], "
        "['pytree']>, 'it': <the object at ['a']['it']>, 'b.it': <the object at ['b']['it']>, "
        "'stateful': <the object at ['pytree']>})"
    )


def test_a_leaf_no_handler_saves_gets_no_such_hint(tmp_path) -> None:
    with pytest.raises(cp.errors.NoHandlerForObjectError) as e:
        cp.save_pytree(tmp_path / "p", {"w": np.ones(1), "x": _Opaque()})
    message = str(e.value)
    assert "no leaf handler accepts the leaves ['x']" in message
    assert "beside the pytree" not in message
    assert "save_checkpointables({'pytree': obj})" not in message  # Fails the same way.


def test_a_handler_registered_by_the_user_and_its_name(tmp_path) -> None:
    class Point:
        pass

    class PointHandler:
        def is_handleable(self, obj):
            return isinstance(obj, Point)

        def is_abstract_handleable(self, abstract):
            return None

        async def save(self, directory, checkpointable):
            raise NotImplementedError

        async def load(self, directory, abstract=None):
            raise NotImplementedError

        async def metadata(self, directory):
            raise NotImplementedError

    cp.handlers.register_handler(PointHandler, checkpointable_name="where")
    try:
        with pytest.raises(cp.errors.NoHandlerForObjectError) as e:
            cp.save_pytree(tmp_path / "p", {"w": np.ones(1), "pt": Point()})
    finally:
        cp.handlers.unregister_handler(PointHandler)
    message = str(e.value)
    assert "['pt'] is an object that the 'point' handler" in message
    assert "registered by you) saves" in message
    assert "'where': <the object at ['pt']>" in message


def test_a_whole_object_keeps_the_core_advice(tmp_path) -> None:
    with pytest.raises(cp.errors.NoHandlerForObjectError, match="The grain handler saves it"):
        cp.save_pytree(tmp_path / "p", _iterator())
