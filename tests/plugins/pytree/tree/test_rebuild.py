"""A ``Recipe`` replays what ``unflatten`` builds, for new values, in fresh containers."""

from __future__ import annotations

from typing import Any

import checkpointables as cp
import numpy as np
import pytest
from checkpointables_pytree.tree import DICT, MAX_DEPTH, SEQUENCE, Recipe, unflatten

D, S = DICT, SEQUENCE
STRUCTURES = {
    "nested dicts and lists": [
        (("a", "w"), (D, D)),
        (("a", "b"), (D, D)),
        (("layers", "0", "w"), (D, S, D)),
        (("layers", "1", "w"), (D, S, D)),
        (("layers", "1", "b"), (D, S, D)),
        (("step",), (D,)),
    ],
    "tuples and a list of one": [
        (("opt", "0", "mu"), (D, S, D)),
        (("opt", "1"), (D, S)),
        (("one", "0"), (D, S)),
    ],
    "a sequence with gaps": [(("xs", "0"), (D, S)), (("xs", "3"), (D, S))],
    "a root list": [(("0",), (S,)), (("1",), (S,)), (("2", "k"), (S, D))],
    "a root leaf": [((), ())],
}
TUPLES = frozenset({("opt",)})


@pytest.mark.parametrize("name", STRUCTURES)
def test_a_recipe_builds_what_unflatten_builds(name) -> None:
    slots = STRUCTURES[name]
    recipe = Recipe.of(slots, TUPLES)
    for round_ in range(2):
        values = [{} if i == 1 else f"value {round_}.{i}" for i in range(len(slots))]
        expected = unflatten([(n, t, v) for (n, t), v in zip(slots, values, strict=True)], TUPLES)
        built = recipe.build(values)
        assert built == expected and type(built) is type(expected)
        assert repr(built) == repr(expected)  # Same kinds and key order at every level.
    if name != "a root leaf":
        assert recipe.build(values) is not recipe.build(values)  # Fresh containers each time.


def test_a_malformed_structure_raises_as_unflatten_does() -> None:
    slots = [(("a",), (D,)), (("a", "b"), (D, D))]
    with pytest.raises(KeyError, match="both a leaf and a container"):
        Recipe.of(slots, on_conflict=KeyError)


def test_the_deepest_tree_a_save_accepts_loads_and_a_deeper_one_is_refused(tmp_path) -> None:
    import checkpointables as cp
    from checkpointables_pytree.tree import MAX_DEPTH

    def nested(depth: int) -> dict:
        tree: Any = np.arange(3)
        for _ in range(depth):
            tree = {"k": tree}
        return tree

    cp.save_pytree(tmp_path / "deepest", nested(MAX_DEPTH))
    loaded = cp.load_pytree(tmp_path / "deepest")
    for _ in range(MAX_DEPTH):
        loaded = loaded["k"]
    assert loaded.tolist() == [0, 1, 2]
    cp.pytree_metadata(tmp_path / "deepest")
    with pytest.raises(cp.errors.InvalidArgumentError, match="more than 256 levels deep"):
        cp.save_pytree(tmp_path / "deeper", nested(MAX_DEPTH + 1))
    assert not (tmp_path / "deeper").exists()


def _nested(depth: int, bottom: Any) -> Any:
    """``{"a": [{"k": {"k": ... bottom}}]}``: ``depth`` levels below the root."""
    tree = bottom
    for _ in range(depth - 2):
        tree = {"k": tree}
    return {"a": [tree]}


@pytest.mark.parametrize("bottom", [{}, [], None, np.arange(3)], ids=repr)
def test_too_deep_names_the_key_path_as_other_errors_do(tmp_path, bottom) -> None:
    # An empty node deepest was named by key objects: (DictKey(key='a'), SequenceKey(idx=0)...
    with pytest.raises(cp.errors.InvalidArgumentError) as e:
        cp.save_pytree(tmp_path / "deeper", {"w": np.ones(2), "deep": _nested(MAX_DEPTH, bottom)})
    assert str(e.value).startswith("['deep']['a'][0]['k']... is nested more than 256 levels")
    assert "Key" not in str(e.value)
    assert not (tmp_path / "deeper").exists()


def test_too_deep_records_are_named_with_their_key_types() -> None:
    names, types = ("a", "0", *("k",) * 300), (D, S, *(D,) * 300)
    with pytest.raises(KeyError, match=r"\['a'\]\[0\]\['k'\]\['k'\]\.\.\. is nested 302 levels"):
        unflatten([(names, types, 1)], on_conflict=KeyError)
