"""Loading with an abstract tree: resharding, casting, types, partial loads, mismatches."""

from __future__ import annotations

import collections

import checkpointables as cp
import jax
import jax.numpy as jnp
import numpy as np
import pytest

P = jax.sharding.PartitionSpec


def _saved_on_4x2(tmp_path, mesh_4x2):
    sharding = jax.sharding.NamedSharding(mesh_4x2, P("x", "y"))
    values = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    cp.save_pytree(tmp_path / "c", {"w": jax.device_put(values, sharding), "b": np.arange(8.0)})
    return values


@pytest.mark.parametrize("spec", [P("x", "y"), P("y", "x"), P(None, "x"), P()])
def test_reshard_4x2_onto_2x4(tmp_path, mesh_4x2, mesh_2x4, spec) -> None:
    values = _saved_on_4x2(tmp_path, mesh_4x2)
    target = jax.sharding.NamedSharding(mesh_2x4, spec)
    abstract = {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=target), "b": np.empty(8)}
    loaded = cp.load_pytree(tmp_path / "c", abstract)
    assert loaded["w"].sharding == target
    np.testing.assert_array_equal(np.asarray(loaded["w"]), values)
    for shard in loaded["w"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), values[shard.index])


def test_reshard_onto_one_device_with_a_cast(tmp_path, mesh_4x2, one_device) -> None:
    values = _saved_on_4x2(tmp_path, mesh_4x2)
    abstract = {
        "w": jax.ShapeDtypeStruct((64, 32), jnp.bfloat16, sharding=one_device),
        "b": np.empty(8),
    }
    loaded = cp.load_pytree(tmp_path / "c", abstract)
    assert loaded["w"].sharding == one_device and loaded["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(loaded["w"]), values.astype(jnp.bfloat16))


def test_numpy_saved_loads_sharded_and_jax_saved_loads_as_numpy(tmp_path, mesh_2x4) -> None:
    cp.save_pytree(tmp_path / "c", {"n": np.arange(16.0).reshape(4, 4), "j": jnp.arange(6)})
    sharding = jax.sharding.NamedSharding(mesh_2x4, P("x"))
    loaded = cp.load_pytree(
        tmp_path / "c",
        {
            "n": jax.ShapeDtypeStruct((4, 4), jnp.float32, sharding=sharding),
            "j": np.empty(6, np.int64),
        },
    )
    assert isinstance(loaded["n"], jax.Array) and loaded["n"].sharding == sharding
    assert loaded["n"].dtype == jnp.float32
    assert type(loaded["j"]) is np.ndarray and loaded["j"].dtype == np.int64
    np.testing.assert_array_equal(loaded["j"], np.arange(6))


def test_shape_dtype_struct_without_sharding_goes_to_the_default_device(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", {"a": np.arange(4, dtype=np.int32)})
    loaded = cp.load_pytree(tmp_path / "c", {"a": jax.ShapeDtypeStruct((4,), jnp.float32)})
    assert loaded["a"].dtype == jnp.float32
    assert loaded["a"].sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])


def test_an_abstract_tree_of_jax_eval_shape_loads_on_the_mesh_in_force(tmp_path) -> None:
    # Explicit mesh axes (jax.make_mesh's default): eval_shape gives an AbstractMesh.
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    sharding = jax.NamedSharding(mesh, jax.sharding.PartitionSpec("x", "y"))
    state = {"w": jax.device_put(jnp.arange(32.0).reshape(8, 4), sharding)}
    cp.save_pytree(tmp_path / "c", state)
    abstract = jax.eval_shape(lambda: state)
    assert isinstance(abstract["w"].sharding.mesh, jax.sharding.AbstractMesh)
    with pytest.raises(cp.errors.InvalidArgumentError, match=r"\['w'\] has a sharding on an abs"):
        cp.load_pytree(tmp_path / "c", abstract)  # Was JAX's ValueError, from its internals.
    with jax.set_mesh(mesh):
        loaded = cp.load_pytree(tmp_path / "c", abstract)
    assert loaded["w"].sharding == sharding
    np.testing.assert_array_equal(loaded["w"], state["w"])


def test_scalar_and_string_abstract_leaves_choose_the_type(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", {"step": 3, "lr": 0.5, "name": "x", "arr0d": np.float32(2.0)})
    loaded = cp.load_pytree(tmp_path / "c", {"step": 0.0, "lr": float, "name": "", "arr0d": 0})
    assert loaded == {"step": 3.0, "lr": 0.5, "name": "x", "arr0d": 2}
    assert type(loaded["step"]) is float and type(loaded["arr0d"]) is int


def test_placeholder_and_none_skip_leaves_and_subtrees(tmp_path) -> None:
    tree = {"params": {"w": np.ones(3), "b": np.zeros(3)}, "opt": {"mu": np.ones(3)}, "step": 4}
    cp.save_pytree(tmp_path / "c", tree)
    loaded = cp.load_pytree(
        tmp_path / "c", {"params": {"w": np.empty(3), "b": cp.PLACEHOLDER}, "opt": None, "step": 0}
    )
    assert loaded["params"]["b"] is cp.PLACEHOLDER and loaded["opt"] is None and loaded["step"] == 4
    np.testing.assert_array_equal(loaded["params"]["w"], np.ones(3))


def test_metadata_is_a_usable_abstract_tree(tmp_path, mesh_4x2) -> None:
    sharding = jax.sharding.NamedSharding(mesh_4x2, P("x"))
    tree = {
        "j": jax.device_put(jnp.arange(8.0), sharding),
        "n": np.arange(3),
        "s": 1.5,
        "i": np.int16(4),
        "t": "text",
        "e": {},
        "tup": (1, 2),
    }
    cp.save_pytree(tmp_path / "c", tree)
    loaded = cp.load_pytree(tmp_path / "c", cp.pytree_metadata(tmp_path / "c").metadata)
    assert loaded["j"].sharding == sharding  # Same devices here: the saved sharding is rebuilt.
    assert type(loaded["n"]) is np.ndarray and loaded["s"] == 1.5 and type(loaded["i"]) is np.int16
    assert loaded["t"] == "text" and loaded["e"] == {} and loaded["tup"] == (1, 2)
    # The whole CheckpointMetadata works too.
    assert cp.load_pytree(tmp_path / "c", cp.pytree_metadata(tmp_path / "c"))["s"] == 1.5


def test_abstract_containers_decide_the_result_types(tmp_path) -> None:
    State = collections.namedtuple("State", ["params", "step"])
    cp.save_pytree(tmp_path / "c", State(params=[np.ones(2), np.zeros(2)], step=3))
    loaded = cp.load_pytree(tmp_path / "c", State(params=(np.empty(2), np.empty(2)), step=0))
    assert isinstance(loaded, State) and isinstance(loaded.params, tuple) and loaded.step == 3


def test_missing_keys_need_partial_load(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", {"a": np.ones(2), "b": {"c": np.zeros(2), "d": 5}})
    with pytest.raises(cp.errors.TreeMismatchError) as info:
        cp.load_pytree(tmp_path / "c", {"a": np.empty(2)})
    message = str(info.value)
    assert "in the checkpoint but not in the abstract tree (2): ['b']['c'], ['b']['d']" in message
    assert "partial_load=True" in message
    loaded = cp.load_pytree(tmp_path / "c", {"a": np.empty(2), "b": {"d": 0}}, partial_load=True)
    assert set(loaded) == {"a", "b"} and loaded["b"] == {"d": 5}
    # The context's option works as well.
    with cp.Context(pytree_options=cp.options.PyTreeOptions(partial_load=True)):
        assert set(cp.load_pytree(tmp_path / "c", {"a": np.empty(2)})) == {"a"}


def test_extra_keys_always_fail_with_a_diff(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", {"a": np.ones(2), "b": [1, 2]})
    abstract = {"a": np.empty(2), "b": [0, 0, 0], "zzz": np.empty(1)}
    for partial in (False, True):
        with pytest.raises(cp.errors.TreeMismatchError) as info:
            cp.load_pytree(tmp_path / "c", abstract, partial_load=partial)
        assert "in the abstract tree but not in the checkpoint (2): ['b'][2], ['zzz']" in str(
            info.value
        )
        assert "partial_load=True" not in str(info.value)  # It would not help here.


def test_a_leaf_where_the_checkpoint_has_a_subtree(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", {"a": {"x": np.ones(2)}})
    with pytest.raises(
        cp.errors.TreeMismatchError, match=r"\['a'\] \(a leaf in the abstract tree, a subtree"
    ):
        cp.load_pytree(tmp_path / "c", {"a": np.empty(2)})


def test_unsupported_abstract_leaves_are_named(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", {"a": np.ones(2)})
    with pytest.raises(cp.errors.TreeMismatchError, match=r"\['a'\] \(object\)"):
        cp.load_pytree(tmp_path / "c", {"a": object()})


def test_loading_a_string_as_an_array_fails_clearly(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", {"s": "text", "a": np.ones(2)})
    with pytest.raises(cp.errors.TreeMismatchError, match=r"\['s'\] was saved as 'string'"):
        cp.load_pytree(tmp_path / "c", {"s": np.empty(2), "a": np.empty(2)})
    with pytest.raises(cp.errors.TreeMismatchError, match=r"\['a'\] was saved as 'np.ndarray'"):
        cp.load_pytree(tmp_path / "c", {"s": "", "a": ""})


def test_shape_mismatch_raises_unless_padding_is_enabled(tmp_path, mesh_2x4) -> None:
    cp.save_pytree(tmp_path / "c", {"a": np.arange(1, 7, dtype=np.float32).reshape(2, 3)})
    with pytest.raises(
        cp.errors.TreeMismatchError, match=r"asks for shape \(4, 3\).*stores shape \(2, 3\)"
    ):
        cp.load_pytree(tmp_path / "c", {"a": np.empty((4, 3), np.float32)})
    options = cp.options.ArrayOptions(enable_padding_and_truncation=True)
    with cp.Context(array_options=options):
        padded = cp.load_pytree(tmp_path / "c", {"a": np.empty((4, 3), np.float32)})["a"]
        truncated = cp.load_pytree(tmp_path / "c", {"a": np.empty((1, 2), np.float32)})["a"]
        sharding = jax.sharding.NamedSharding(mesh_2x4, P("x", None))
        sharded = cp.load_pytree(
            tmp_path / "c", {"a": jax.ShapeDtypeStruct((4, 4), jnp.float32, sharding=sharding)}
        )["a"]
    np.testing.assert_array_equal(padded, [[1, 2, 3], [4, 5, 6], [0, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(truncated, [[1, 2]])
    np.testing.assert_array_equal(
        np.asarray(sharded), [[1, 2, 3, 0], [4, 5, 6, 0], [0] * 4, [0] * 4]
    )
    assert sharded.sharding == sharding


def test_large_array_partial_regions_are_read_per_shard(tmp_path, mesh_4x2, mesh_2x4) -> None:
    # Over the batched path's size limit: read region by region through the zarr3 driver.
    values = np.random.default_rng(1).standard_normal((1024, 512)).astype(np.float32)
    saved = jax.device_put(values, jax.sharding.NamedSharding(mesh_4x2, P("x", "y")))
    cp.save_pytree(tmp_path / "c", {"w": saved})
    target = jax.sharding.NamedSharding(mesh_2x4, P("y", "x"))
    loaded = cp.load_pytree(
        tmp_path / "c", {"w": jax.ShapeDtypeStruct(values.shape, jnp.float32, sharding=target)}
    )
    for shard in loaded["w"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), values[shard.index])
