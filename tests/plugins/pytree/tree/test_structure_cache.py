"""Saves of one structure reuse what depends only on the structure; a change is never missed.

A training loop saves trees of one structure again and again: the plugin keeps
the key paths, key names and metadata text of recent structures (``_tree``,
``_tree_metadata``). These tests save real trees whose structure changes
between consecutive saves and load each checkpoint back.
"""

from __future__ import annotations

import json

import checkpointables as cp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpointables_pytree import tree as tree_room
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
    a, b = tree_room.flatten(first), tree_room.flatten(second)
    assert [leaf.names for leaf in a.leaves] == [leaf.names for leaf in b.leaves]
    assert all(leaf.value is v for leaf, v in zip(b.leaves, jax.tree.leaves(second), strict=True))
    assert b.structure.empty == ((((jax.tree_util.DictKey("empty"),), tree_room.EMPTY_DICT),))
    assert b.structure is a.structure


def test_flatten_of_keys_jax_cannot_sort() -> None:
    flat = tree_room.flatten({1: np.ones(2), "a": np.zeros(2)})
    assert [leaf.names for leaf in flat.leaves] == [("1",), ("a",)]


def test_a_metadata_text_parsed_again_shares_its_entries_and_derived_plans(tmp_path) -> None:
    cp.save_pytree(tmp_path / "a", _tree_of(1))
    cp.save_pytree(tmp_path / "b", _tree_of(2))  # Same structure: the same _METADATA text.
    path = tmp_path / "a" / "pytree" / tree_room.METADATA_FILE
    text = path.read_bytes()
    assert (tmp_path / "b" / "pytree" / tree_room.METADATA_FILE).read_bytes() == text
    first = tree_room.parse_tree_metadata(path, text)
    first.extra["changed"] = True
    first.checksum_recorded = True
    first.derived["plan"] = "made once"
    again = tree_room.parse_tree_metadata(path, text)
    assert again.entries is first.entries  # Shared, never changed by loads.
    assert again.derived["plan"] == "made once"
    assert "changed" not in again.extra and not again.checksum_recorded  # The caller's own.
    assert again == tree_room.parse_tree_metadata_uncached(path, text)
    other = text.replace(b'"step"', b'"steps"')
    assert other != text
    assert "plan" not in tree_room.parse_tree_metadata(path, other).derived
    _save_and_check(tmp_path / "c", _tree_of(3))


def test_a_cached_read_plan_follows_the_registry_and_hands_out_fresh_containers(tmp_path) -> None:
    from checkpointables_pytree import ArrayLeafHandler, NumpyLeafHandler

    key = jax.random.key(8)
    cp.save_pytree(tmp_path / "c", {"k": key, "e": {}, "x": np.arange(3)})
    only_arrays = cp.serialization.LeafHandlerRegistry()
    without_keys = cp.serialization.LeafHandlerRegistry()
    for registry in (only_arrays, without_keys):
        registry.add(
            jax.Array,
            cp.serialization.AbstractShardedArray,
            ArrayLeafHandler,
            secondary_typestrs=("jax.Array",),
        )
    without_keys.add(
        np.ndarray,
        cp.serialization.AbstractArray,
        NumpyLeafHandler,
        secondary_typestrs=("np.ndarray",),
    )
    # The same _METADATA text each time, read by different leaf handlers.
    for registry, is_key in ((None, True), (without_keys, False), (None, True)):
        with cp.Context(pytree_options=cp.options.PyTreeOptions(leaf_handler_registry=registry)):
            loaded = cp.load_pytree(tmp_path / "c")
        assert jax.dtypes.issubdtype(loaded["k"].dtype, jax.dtypes.prng_key) == is_key
        assert loaded["e"] == {}
        loaded["e"]["added"] = 1  # Each load's empty containers are its own.
        np.testing.assert_array_equal(loaded["x"], np.arange(3))
    arrays_only = cp.Context(
        pytree_options=cp.options.PyTreeOptions(leaf_handler_registry=only_arrays)
    )
    with arrays_only, pytest.raises(cp.errors.MissingHandlerError, match="np.ndarray"):
        cp.load_pytree(tmp_path / "c")


def test_abstract_leaves_of_one_type_but_other_dtypes_pick_their_own_handlers(tmp_path) -> None:
    key = jax.random.key(3)
    tree = {"a": jnp.arange(4.0), "k": key, "z": jnp.arange(3), "n": np.ones(2, np.int8)}
    cp.save_pytree(tmp_path / "c", tree)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
    abstract["n"] = np.empty(2, np.float32)  # Loads the stored int8 as float32.
    for _ in range(2):  # The second load reuses the parsed text.
        loaded = cp.load_pytree(tmp_path / "c", abstract)
        assert jax.dtypes.issubdtype(loaded["k"].dtype, jax.dtypes.prng_key)
        np.testing.assert_array_equal(
            np.asarray(jax.random.key_data(loaded["k"])), np.asarray(jax.random.key_data(key))
        )
        np.testing.assert_array_equal(np.asarray(loaded["a"]), np.arange(4.0))
        np.testing.assert_array_equal(np.asarray(loaded["z"]), np.arange(3))
        assert isinstance(loaded["n"], np.ndarray) and loaded["n"].dtype == np.float32


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


def _metadata_text(path) -> str:
    return (path / "pytree" / tree_room.METADATA_FILE).read_text()


def test_saved_metadata_text_is_the_json_encoders(tmp_path) -> None:
    # Built from the structure's template and the arrays' shared records: the same text as
    # the entries encoded one by one.
    key = jax.random.key(1)
    tree = _tree_of(1, t=(np.ones(2), jnp.arange(3)), k=key, none=None, s="x", e=[])
    for name in ("a", "b"):  # The second save reuses the template and the records' texts.
        cp.save_pytree(tmp_path / name, tree)
        text = _metadata_text(tmp_path / name)
        parsed = tree_room.parse_tree_metadata_uncached(tmp_path / name, text)
        rebuilt = tree_room.TreeMetadata(
            entries=parsed.entries,
            tuple_paths=parsed.tuple_paths,
            own_value_types=parsed.own_value_types,
            strings_crc32c=parsed.strings_crc32c,
        )
        assert text == rebuilt.to_json_text()


def test_array_layouts_are_kept_while_shapes_and_dtypes_stay(tmp_path) -> None:
    tree = {f"w{i}": np.full((i + 1, 2), i, np.float32) for i in range(6)}
    structure = tree_room.flatten(tree).structure
    cp.save_pytree(tmp_path / "a", tree)
    plan = structure.derived[("array_layouts", "numpy")]
    _save_and_check(tmp_path / "b", {k: v + 1 for k, v in tree.items()})
    assert structure.derived[("array_layouts", "numpy")] is plan  # Reused.
    assert _metadata_text(tmp_path / "b") == _metadata_text(tmp_path / "a")
    changed = {**tree, "w3": np.zeros((5, 5), np.float32), "w4": np.arange(3)}
    _save_and_check(tmp_path / "c", changed)
    assert structure.derived[("array_layouts", "numpy")] is not plan
    stored = cp.pytree_metadata(tmp_path / "c").metadata
    assert stored["w3"].shape == (5, 5) and stored["w4"].dtype == np.arange(3).dtype
    _save_and_check(tmp_path / "d", tree)
    assert _metadata_text(tmp_path / "d") == _metadata_text(tmp_path / "a")


def test_compression_and_storage_dtype_changed_between_saves(tmp_path) -> None:
    # "b" is big-endian: stored (and loaded) in the native byte order.
    tree = {"a": np.arange(6.0).reshape(2, 3), "b": np.arange(4, dtype=">i4"), "c": np.ones(0)}
    native = {**tree, "b": np.arange(4, dtype=np.int32)}

    def save_and_check(path, stored_dtype=None) -> None:
        cp.save_pytree(path, tree)
        loaded = cp.load_pytree(path)
        for name, want in native.items():
            dtype = want.dtype if stored_dtype is None else stored_dtype
            assert loaded[name].dtype == dtype and loaded[name].shape == want.shape
            np.testing.assert_array_equal(loaded[name], want)

    save_and_check(tmp_path / "plain")
    with cp.Context(array_options=cp.options.ArrayOptions(use_compression=True)):
        save_and_check(tmp_path / "zstd")
    document = json.loads(_metadata_text(tmp_path / "zstd"))["tree_metadata"]
    assert document["('a',)"]["value_metadata"]["checkpointables"]["one_chunk_shards"] is False
    storage = cp.options.ArrayStorageOptions(dtype=np.float32)
    with cp.Context(array_options=cp.options.ArrayOptions(storage_options=storage)):
        save_and_check(tmp_path / "f32", np.dtype(np.float32))
    save_and_check(tmp_path / "again")
    assert _metadata_text(tmp_path / "again") == _metadata_text(tmp_path / "plain")


def test_an_unstorable_dtype_names_its_first_leaf_in_a_cached_structure(tmp_path) -> None:
    tree = {"a": np.ones(2), "b": np.ones(2), "c": np.ones(2)}
    _save_and_check(tmp_path / "ok", tree)
    bad = {"a": np.ones(2), "b": np.array(["x"]), "c": np.array([{}], dtype=object)}
    with pytest.raises(cp.errors.NoHandlerForObjectError, match=r"\['b'\].*dtype <U1"):
        cp.save_pytree(tmp_path / "bad", bad)
    assert not (tmp_path / "bad").exists()


def test_jax_array_layouts_follow_shape_changes(tmp_path) -> None:
    def tree_of(n: int) -> dict[str, jax.Array]:
        return {"a": jnp.arange(float(n)), "b": jnp.ones((2, n), jnp.bfloat16), "z": jnp.ones(0)}

    for name, n in (("a", 3), ("b", 3), ("c", 5), ("d", 3)):
        tree = tree_of(n)
        _save_and_check(tmp_path / name, tree)
        stored = cp.pytree_metadata(tmp_path / name).metadata
        assert stored["b"].shape == (2, n) and stored["b"].sharding == tree["b"].sharding
        assert stored["b"].storage.write_shape == (2, n)
        document = json.loads((tmp_path / name / "pytree/array_metadatas/process_0").read_text())
        recorded = {
            m["array_metadata"]["param_name"]: m["array_metadata"]
            for m in document["array_metadatas"]
        }
        assert recorded["a"]["write_shape"] == recorded["a"]["chunk_shape"] == [n]
    assert _metadata_text(tmp_path / "d") == _metadata_text(tmp_path / "a")


@pytest.mark.fast_path
def test_the_database_layout_is_kept_while_the_arrays_keep_their_sizes(tmp_path) -> None:
    from checkpointables_pytree import io

    def tree_of(step: int, big: int = 4096) -> dict[str, np.ndarray]:
        # Values in data files (over 1 KiB) and inline in the b-tree.
        return {"big": np.arange(big) + step, "small": np.arange(3.0) + step, "mid": np.ones(600)}

    def kept_layout(tree):
        return tree_room.flatten(tree).structure.derived[io.DATABASE_LAYOUT][1]

    _save_and_check(tmp_path / "a", tree_of(0))
    first = kept_layout(tree_of(0))
    _save_and_check(tmp_path / "b", tree_of(1))
    assert kept_layout(tree_of(1)) is first  # Same shapes and dtypes: new values only.
    _save_and_check(tmp_path / "c", tree_of(2, big=9000))  # A value changed its size.
    assert kept_layout(tree_of(2)) is not first
    as_float = {**tree_of(3), "big": np.arange(4096, dtype=np.float32)}
    _save_and_check(tmp_path / "d", as_float)
    _save_and_check(tmp_path / "e", tree_of(4))


def test_a_save_keeps_no_array_alive_after_it_returns(tmp_path) -> None:
    # A structure not seen before is walked in Python; nothing of that walk may hold the
    # tree's arrays once the save returned (an import saves batch after batch of new
    # structures: each batch's arrays stayed until the garbage collector ran).
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        for i in range(3):
            values = {f"never_seen_{i}": np.ones(1 << 16, np.float32), "j": jnp.ones(4) + i}
            alive = [weakref.ref(v) for v in values.values()]
            cp.save_pytree(tmp_path / str(i), values)
            cp.partial.save(tmp_path / f"partial{i}", values)
            del values
            assert [ref() for ref in alive] == [None, None]
    finally:
        gc.enable()
