"""Pytree checkpoints and the real orbax-checkpoint (0.12.8): each reads the other's.

Marked ``orbax``: deselect with ``-m "not orbax"``.
"""

from __future__ import annotations

import json
import shutil

import checkpointables as cp
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint import v1 as ocp_v1

pytestmark = pytest.mark.orbax
P = jax.sharding.PartitionSpec
# Orbax warns when it restores a jax.Array from the `_sharding` file.
ORBAX_SHARDING_WARNING = "ignore:Sharding info not provided when restoring:UserWarning"


def _tree(mesh):
    sharding = jax.sharding.NamedSharding(mesh, P("x", "y"))
    return {
        "params": {
            "kernel": jax.device_put(jnp.arange(64.0, dtype=jnp.float32).reshape(8, 8), sharding),
            "bias": np.linspace(0, 1, 5, dtype=np.float32),
            "big": np.random.default_rng(0).standard_normal((300, 1000)),  # driver path
        },
        "opt": [jnp.zeros(3, jnp.bfloat16), {"count": jnp.array(4, jnp.int32)}],
        "step": 12,
        "lr": 0.125,
        "name": "run-7",
        "empty": {},
        "nothing": None,
    }


def _assert_equal(loaded, expected) -> None:
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(expected)
    for a, b in zip(
        jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(expected), strict=True
    ):
        if isinstance(b, np.ndarray | jax.Array):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:
            assert a == b and type(a) is type(b)


@pytest.mark.filterwarnings(ORBAX_SHARDING_WARNING)
def test_orbax_v1_loads_ours(tmp_path, mesh_4x2) -> None:
    tree = _tree(mesh_4x2)
    cp.save_pytree(tmp_path / "c", tree)
    _assert_equal(ocp_v1.load(tmp_path / "c"), tree)
    # With an abstract tree Orbax reshards, reading our chunks through its own code path.
    abstract = jax.tree_util.tree_map(
        lambda x: ocp_v1.arrays.to_shape_dtype_struct(x) if isinstance(x, jax.Array) else x, tree
    )
    loaded = ocp_v1.load(tmp_path / "c", abstract)
    assert loaded["params"]["kernel"].sharding == tree["params"]["kernel"].sharding
    metadata = ocp_v1.metadata(tmp_path / "c").metadata
    assert metadata["params"]["kernel"].shape == (8, 8)


def test_orbax_v0_restores_ours(tmp_path) -> None:
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "b": np.ones(3, np.float32), "step": 3}
    cp.save_pytree(tmp_path / "c", tree)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(
            tmp_path / "c" / "pytree", jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, tree)
        )
    _assert_equal(restored, tree)


def test_we_load_orbax_v1(tmp_path, mesh_4x2, mesh_2x4) -> None:
    tree = _tree(mesh_4x2)
    ocp_v1.save(tmp_path / "c", tree)
    _assert_equal(cp.load_pytree(tmp_path / "c"), tree)
    metadata = cp.pytree_metadata(tmp_path / "c").metadata
    assert metadata["params"]["kernel"].shape == (8, 8)
    assert metadata["params"]["kernel"].sharding == tree["params"]["kernel"].sharding
    assert metadata["step"] == 0 and metadata["name"] == ""
    # Reshard an Orbax checkpoint onto another mesh.
    target = jax.sharding.NamedSharding(mesh_2x4, P("y", "x"))
    abstract = cp.pytree_metadata(tmp_path / "c").metadata
    abstract["params"]["kernel"] = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=target)
    loaded = cp.load_pytree(tmp_path / "c", abstract)
    assert loaded["params"]["kernel"].sharding == target
    np.testing.assert_array_equal(
        np.asarray(loaded["params"]["kernel"]), np.arange(64.0).reshape(8, 8)
    )
    # Orbax compresses chunks but checksums only shard indexes: verify still reads every
    # chunk, and says (a note, not a problem) that their values could not be checked.
    handler = cp.handlers.get("pytree")()
    found = cp._asyncio.run_sync(handler.verify(tmp_path / "c" / "state"))
    assert [type(f) for f in found] == [cp.protocols.VerifyNote]
    assert found[0].startswith("7 array(s) carry no checksum of their chunk data")


def test_we_load_orbax_v0_standard_checkpointer(tmp_path) -> None:
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "b": np.ones(3, np.float32), "step": 3, "e": {}}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "c", tree)
    _assert_equal(cp.load_pytree(tmp_path / "c"), tree)


def test_we_load_orbax_v0_checkpoint_manager(tmp_path) -> None:
    tree = {"w": jnp.arange(4.0), "n": np.arange(3)}
    with ocp.CheckpointManager(tmp_path / "run", item_names=("state",)) as manager:
        manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(tree)))
        manager.wait_until_finished()
    _assert_equal(cp.load_pytree(tmp_path / "run" / "1"), tree)


def test_we_load_orbax_dotted_keys_and_zarr2_without_ocdbt(tmp_path) -> None:
    tree = {"a.b": np.arange(3), "c": {"d": np.ones(2)}}
    ocp_v1.save(tmp_path / "dotted", tree)
    _assert_equal(cp.load_pytree(tmp_path / "dotted"), tree)
    options = ocp_v1.options.ArrayOptions(
        saving=ocp_v1.options.ArrayOptions.Saving(use_ocdbt=False, use_zarr3=False)
    )
    with ocp_v1.Context(array_options=options):
        ocp_v1.save(tmp_path / "zarr2", {"x": np.arange(4.0), "y": 2})
    _assert_equal(cp.load_pytree(tmp_path / "zarr2"), {"x": np.arange(4.0), "y": 2})


def _key_tree(mesh):
    sharding = jax.sharding.NamedSharding(mesh, P("x"))
    return {
        "fry": jax.random.key(0),
        "rbg": jax.random.split(jax.random.key(1, impl="rbg"), 3),
        "urbg": jax.random.key(2, impl="unsafe_rbg"),
        "sharded": jax.device_put(jax.random.split(jax.random.key(3), 8), sharding),
        "w": jnp.ones(2),
    }


def _assert_same_keys(loaded, expected) -> None:
    assert loaded.keys() == expected.keys()
    for name, value in expected.items():
        assert loaded[name].dtype == value.dtype, name
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            value, got = jax.random.key_data(value), jax.random.key_data(loaded[name])
        else:
            got = loaded[name]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(value))


def _abstract_with_shardings(tree):
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
    )


def test_orbax_metadata_with_its_database_nodes_missing_is_an_integrity_error(tmp_path) -> None:
    ocp_v1.save(tmp_path / "c", {"a": np.arange(6, dtype=np.int32), "n": 7})
    shutil.rmtree(tmp_path / "c" / "state" / "d")  # The merged database's root node.
    with pytest.raises(cp.errors.IntegrityError, match=r"state/d/.* failed its integrity check"):
        cp.pytree_metadata(tmp_path / "c")  # Was TensorStore's ValueError.


@pytest.mark.parametrize("value", [None, 5, [1], {}])
def test_a_string_leaf_stored_as_another_json_value_is_a_metadata_error(tmp_path, value) -> None:
    # Orbax's _strings.json has no checksum: null loaded as "None".
    ocp_v1.save(tmp_path / "c", {"s": "hello", "n": 7})
    file = tmp_path / "c" / "state" / "_strings.json"
    file.write_text(json.dumps({k: value for k in json.loads(file.read_text())}))
    with pytest.raises(cp.errors.MetadataError, match=r"for the string leaf \['s'\], not a str"):
        cp.load_pytree(tmp_path / "c")


@pytest.mark.filterwarnings(ORBAX_SHARDING_WARNING)
def test_prng_keys_both_ways(tmp_path, mesh_4x2) -> None:
    tree = _key_tree(mesh_4x2)
    cp.save_pytree(tmp_path / "ours", tree)
    _assert_same_keys(ocp_v1.load(tmp_path / "ours"), tree)
    from_orbax = ocp_v1.load(tmp_path / "ours", _abstract_with_shardings(tree))
    _assert_same_keys(from_orbax, tree)
    assert from_orbax["sharded"].sharding.is_equivalent_to(tree["sharded"].sharding, 1)

    ocp_v1.save(tmp_path / "theirs", tree)
    _assert_same_keys(cp.load_pytree(tmp_path / "theirs"), tree)
    loaded = cp.load_pytree(tmp_path / "theirs", _abstract_with_shardings(tree))
    _assert_same_keys(loaded, tree)
    assert loaded["sharded"].sharding.is_equivalent_to(tree["sharded"].sharding, 1)
    metadata = cp.pytree_metadata(tmp_path / "theirs").metadata
    assert metadata["rbg"].shape == (3,) and metadata["rbg"].dtype == tree["rbg"].dtype


@pytest.mark.filterwarnings(ORBAX_SHARDING_WARNING)
def test_orbax_loads_our_empty_nodes(tmp_path) -> None:
    import optax

    params = {"w": jnp.ones(3)}
    state = {"opt": optax.adam(1e-3).init(params), "params": params}
    cp.save_pytree(tmp_path / "c", state)
    loaded = ocp_v1.load(tmp_path / "c", _abstract_with_shardings(state))
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(state)
    assert isinstance(loaded["opt"][1], optax.EmptyState)


def test_orbax_loads_bytes_leaves_as_uint8_arrays(tmp_path) -> None:
    tree = {"blob": b"\x00\xffbinary", "empty": b"", "w": np.ones(2)}
    cp.save_pytree(tmp_path / "c", tree)
    loaded = ocp_v1.load(tmp_path / "c")
    assert loaded["blob"].dtype == np.uint8 and loaded["blob"].tobytes() == tree["blob"]
    assert loaded["empty"].shape == (0,)
    # Here they load as bytes, with or without an abstract tree.
    assert cp.load_pytree(tmp_path / "c")["blob"] == tree["blob"]
    with_abstract = cp.load_pytree(tmp_path / "c", {"blob": b"", "empty": b"", "w": np.empty(2)})
    assert with_abstract["blob"] == tree["blob"] and with_abstract["empty"] == b""


def test_orbax_loads_a_checkpoint_of_a_pytree_and_json(tmp_path) -> None:
    cp.save_checkpointables(
        tmp_path / "c", {"state": {"w": np.arange(3.0), "b": b"xy"}, "config": {"lr": 0.1}}
    )
    loaded = ocp_v1.load_checkpointables(tmp_path / "c")
    assert loaded["config"] == {"lr": 0.1}
    np.testing.assert_array_equal(loaded["state"]["w"], np.arange(3.0))


@pytest.mark.filterwarnings(ORBAX_SHARDING_WARNING)
def test_orbax_loads_every_kind_of_leaf_we_save(tmp_path) -> None:
    import collections

    import ml_dtypes

    Pair = collections.namedtuple("Pair", ["a", "b"])
    tree = {
        "scalars": [3, 2.5, True, 1 + 2j, np.float32(1.5), np.int8(-3), "text", b"bytes"],
        "arrays": {
            "bf16": jnp.ones(3, jnp.bfloat16),
            "int4": np.arange(4).astype(ml_dtypes.int4),
            "f8": np.ones(2, ml_dtypes.float8_e4m3fn),
            "complex": np.ones(2, np.complex64),
            "bools": np.array([True, False]),
            "zero_size": np.zeros((0, 3)),
        },
        "containers": {"tuple": (1, 2.0), "pair": Pair(np.ones(1), 2), "empty": [{}, [], ()]},
        "none": None,
        "key": jax.random.key(1),
    }
    cp.save_pytree(tmp_path / "c", tree)
    loaded = ocp_v1.load(tmp_path / "c")
    assert loaded["scalars"][:7] == tree["scalars"][:7]
    assert loaded["scalars"][7].tobytes() == b"bytes"  # Orbax has no bytes leaves: uint8.
    for name, value in tree["arrays"].items():
        assert loaded["arrays"][name].dtype == value.dtype, name
        np.testing.assert_array_equal(np.asarray(loaded["arrays"][name]), np.asarray(value))
    assert loaded["containers"]["pair"]["b"] == 2 and loaded["containers"]["empty"] == [{}, [], ()]
    assert loaded["none"] is None and loaded["key"].dtype == tree["key"].dtype
