"""Saves of one structure reuse what depends only on the structure; a change is never missed.

A training loop saves trees of one structure again and again: the plugin keeps
the key paths, key names and metadata text of recent structures (``_tree``,
``_tree_metadata``). These tests save real trees whose structure changes
between consecutive saves and load each checkpoint back.
"""

from __future__ import annotations

import checkpointables as cp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpointables_pytree import _tree, _tree_metadata
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _tree_of(seed: int, **overrides: object) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    tree: dict[str, object] = {
        "layer": {"w": rng.random((4, 3), dtype=np.float32), "b": rng.random(3, dtype=np.float32)},
        "step": seed,
        "empty": {},
    }
    tree.update(overrides)
    return tree


def _save_and_check(path, tree) -> None:
    cp.save_pytree(path, tree)
    loaded = cp.load_pytree(path)
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(tree)
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(tree), strict=True):
        got, want = np.asarray(got), np.asarray(want)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_same_structure_new_values_each_save(tmp_path) -> None:
    for step in range(3):
        _save_and_check(tmp_path / f"s{step}", _tree_of(step))


def test_key_added_renamed_and_removed_between_saves(tmp_path) -> None:
    _save_and_check(tmp_path / "a", _tree_of(1))
    _save_and_check(tmp_path / "b", _tree_of(2, extra=np.arange(5.0)))
    # Same number of leaves as "b", one key renamed: a different structure.
    _save_and_check(tmp_path / "c", _tree_of(3, other=np.arange(5.0)))
    _save_and_check(tmp_path / "d", {"layer": {"w": np.ones(2)}})
    _save_and_check(tmp_path / "e", _tree_of(4))


def test_dtype_and_shape_changed_between_saves(tmp_path) -> None:
    base = _tree_of(1)
    _save_and_check(tmp_path / "a", base)
    as_int = _tree_of(
        1, layer={"w": np.arange(12, dtype=np.int32).reshape(4, 3), "b": base["layer"]["b"]}
    )
    _save_and_check(tmp_path / "b", as_int)
    reshaped = _tree_of(
        1, layer={"w": np.arange(12.0, dtype=np.float32).reshape(3, 4), "b": base["layer"]["b"]}
    )
    _save_and_check(tmp_path / "c", reshaped)
    _save_and_check(tmp_path / "d", base)


def test_sharding_changed_between_saves(tmp_path, mesh_4x2) -> None:
    values = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    shardings = [
        NamedSharding(mesh_4x2, P("x", "y")),
        NamedSharding(mesh_4x2, P("y", "x")),
        NamedSharding(mesh_4x2, P(None, "y")),
        NamedSharding(mesh_4x2, P("x", "y")),
    ]
    for i, sharding in enumerate(shardings):
        tree = {"w": jax.device_put(values + i, sharding), "b": jnp.arange(3.0) + i}
        path = tmp_path / f"s{i}"
        cp.save_pytree(path, tree)
        recorded = cp.pytree_metadata(path).metadata["w"]
        assert recorded.sharding.spec == sharding.spec, i
        abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree
        )
        loaded = cp.load_pytree(path, abstract)
        assert loaded["w"].sharding == sharding
        np.testing.assert_array_equal(np.asarray(loaded["w"]), values + i)
        np.testing.assert_array_equal(np.asarray(loaded["b"]), np.arange(3.0) + i)


def test_flatten_reuses_a_structure_and_returns_this_trees_leaves() -> None:
    first, second = _tree_of(1), _tree_of(2)
    a, b = _tree.flatten(first), _tree.flatten(second)
    assert [leaf.names for leaf in a.leaves] == [leaf.names for leaf in b.leaves]
    assert all(leaf.value is v for leaf, v in zip(b.leaves, jax.tree.leaves(second), strict=True))
    assert b.structure.empty == ((((jax.tree_util.DictKey("empty"),), _tree.EMPTY_DICT),))
    assert b.structure is a.structure


def test_flatten_of_keys_jax_cannot_sort() -> None:
    flat = _tree.flatten({1: np.ones(2), "a": np.zeros(2)})
    assert [leaf.names for leaf in flat.leaves] == [("1",), ("a",)]


def test_a_metadata_text_parsed_again_is_a_copy_the_caller_may_change(tmp_path) -> None:
    cp.save_pytree(tmp_path / "a", _tree_of(1))
    cp.save_pytree(tmp_path / "b", _tree_of(2))  # Same structure: the same _METADATA text.
    path = tmp_path / "a" / "pytree" / _tree_metadata.METADATA_FILE
    text = path.read_bytes()
    assert (tmp_path / "b" / "pytree" / _tree_metadata.METADATA_FILE).read_bytes() == text
    first = _tree_metadata.parse_tree_metadata(path, text)
    first.entries[0].extra["changed"] = True
    first.entries.pop()
    again = _tree_metadata.parse_tree_metadata(path, text)
    assert "changed" not in again.entries[0].extra
    assert len(again.entries) == len(first.entries) + 1
    assert again == _tree_metadata._parse_tree_metadata(path, text)
    _save_and_check(tmp_path / "c", _tree_of(3))


def test_leaf_types_changed_under_one_structure(tmp_path) -> None:
    # One treedef, leaves taken by different leaf handlers from one save to the next.
    as_jax = {"a": jnp.arange(3.0), "b": jnp.ones(2), "c": jnp.zeros(1)}
    _save_and_check(tmp_path / "a", as_jax)
    _save_and_check(tmp_path / "b", {"a": np.arange(3.0), "b": jnp.ones(2), "c": 7})
    _save_and_check(tmp_path / "c", {"a": 1.5, "b": np.ones(2), "c": jnp.zeros(1)})
    _save_and_check(tmp_path / "d", as_jax)


@jax.tree_util.register_pytree_with_keys_class
class _Twins:
    """A node whose two children have keys of the same name."""

    def __init__(self, first: object, second: object) -> None:
        self.first, self.second = first, second

    def tree_flatten_with_keys(self):
        key = jax.tree_util.GetAttrKey("x")
        return ((key, self.first), (key, self.second)), None

    def tree_flatten(self):
        return (self.first, self.second), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        return cls(*children)


def test_keys_of_one_name_raise_on_every_save_of_a_cached_structure(tmp_path) -> None:
    _save_and_check(tmp_path / "ok", {"n": {"x": np.ones(2), "y": np.zeros(2)}})
    for name in ("a", "b"):  # The second save finds the structure cached.
        with pytest.raises(cp.errors.InvalidArgumentError, match="same string form"):
            cp.save_pytree_async(tmp_path / name, {"n": _Twins(jnp.ones(2), jnp.zeros(2))})
        assert not (tmp_path / name).exists()
