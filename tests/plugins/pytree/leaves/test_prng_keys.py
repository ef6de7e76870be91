"""Typed PRNG keys (``jax.random.key``) save and load as keys, for all JAX implementations."""

from __future__ import annotations

import json
import os

import checkpointables as cp
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from checkpointables_pytree import PRNGKeyMetadata

P = jax.sharding.PartitionSpec
IMPLS = ["threefry2x32", "rbg", "unsafe_rbg"]


def _same_keys(loaded, expected) -> None:
    assert loaded.dtype == expected.dtype and loaded.shape == expected.shape
    np.testing.assert_array_equal(
        np.asarray(jax.random.key_data(loaded)), np.asarray(jax.random.key_data(expected))
    )
    # The restored keys draw the same numbers.
    draw = jax.vmap(lambda k: jax.random.bits(k, (3,)))
    flat_loaded, flat_expected = loaded.reshape(-1), expected.reshape(-1)
    np.testing.assert_array_equal(np.asarray(draw(flat_loaded)), np.asarray(draw(flat_expected)))


@pytest.mark.parametrize("impl", IMPLS)
def test_keys_round_trip_without_an_abstract_tree(tmp_path, impl) -> None:
    key = jax.random.key(7, impl=impl)
    tree = {"key": key, "keys": jax.random.split(key, (2, 3)), "w": jnp.ones(2)}
    cp.save_pytree(tmp_path / "c", tree)
    loaded = cp.load_pytree(tmp_path / "c")
    _same_keys(loaded["key"], tree["key"])
    _same_keys(loaded["keys"], tree["keys"])
    metadata = cp.pytree_metadata(tmp_path / "c").metadata["keys"]
    assert isinstance(metadata, PRNGKeyMetadata)
    assert metadata.shape == (2, 3) and metadata.impl == impl
    assert metadata.dtype == jax.random.key_dtype(impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_sharded_keys_load_onto_another_mesh(tmp_path, mesh_4x2, mesh_2x4, impl) -> None:
    keys = jax.random.split(jax.random.key(3, impl=impl), (8, 4))
    saved = jax.device_put(keys, jax.sharding.NamedSharding(mesh_4x2, P("x", "y")))
    cp.save_pytree(tmp_path / "c", {"keys": saved})
    target = jax.sharding.NamedSharding(mesh_2x4, P("y"))
    abstract = {"keys": jax.ShapeDtypeStruct((8, 4), jax.random.key_dtype(impl), sharding=target)}
    loaded = cp.load_pytree(tmp_path / "c", abstract)["keys"]
    # JAX spells key shardings in full (P("y", None)), as jax.device_put(keys, target) does.
    assert loaded.sharding == jax.device_put(keys, target).sharding
    assert loaded.sharding.is_equivalent_to(target, 2)
    _same_keys(loaded, keys)
    # Each device holds its part of the keys.
    for shard in loaded.addressable_shards:
        np.testing.assert_array_equal(
            np.asarray(jax.random.key_data(shard.data)),
            np.asarray(jax.random.key_data(keys))[shard.index],
        )
    # Without an abstract tree: on the default device; with the metadata: as saved.
    _same_keys(cp.load_pytree(tmp_path / "c")["keys"], keys)
    as_saved = cp.load_pytree(tmp_path / "c", cp.pytree_metadata(tmp_path / "c").metadata)
    assert as_saved["keys"].sharding.is_equivalent_to(saved.sharding, 2)


def test_keys_load_into_fresh_keys_and_onto_one_device(tmp_path, one_device) -> None:
    tree = {"rng": jax.random.key(1), "keys": jax.random.split(jax.random.key(2), 4)}
    cp.save_pytree(tmp_path / "c", tree)
    # A freshly initialised state is a valid abstract tree: its keys are replaced.
    fresh = {"rng": jax.random.key(99), "keys": jax.random.split(jax.random.key(98), 4)}
    loaded = cp.load_pytree(tmp_path / "c", fresh)
    _same_keys(loaded["rng"], tree["rng"])
    _same_keys(loaded["keys"], tree["keys"])
    abstract = {
        "rng": jax.ShapeDtypeStruct((), jax.random.key_dtype("threefry2x32"), sharding=one_device),
        "keys": cp.PLACEHOLDER,
    }
    loaded = cp.load_pytree(tmp_path / "c", abstract)
    assert loaded["rng"].sharding == one_device
    _same_keys(loaded["rng"], tree["rng"])


def test_keys_are_stored_as_orbax_stores_them(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", {"k": jax.random.key(0, impl="rbg")})
    directory = tmp_path / "c" / "pytree"
    entry = json.loads((directory / "_METADATA").read_text())["tree_metadata"]["('k',)"]
    assert entry["value_metadata"]["value_type"] == "jax.Array"
    document = json.loads((directory / "array_metadatas" / "process_0").read_text())
    (item,) = document["array_metadatas"]
    assert item["array_metadata"]["param_name"] == "k"
    assert item["array_metadata"]["ext_metadata"] == {"random_key_impl": "rbg"}
    # The key data: four uint32 for rbg.
    as_data = cp.load_pytree(tmp_path / "c", {"k": np.empty(4, np.uint32)})["k"]
    np.testing.assert_array_equal(
        as_data, np.asarray(jax.random.key_data(jax.random.key(0, impl="rbg")))
    )


def test_key_data_saved_as_an_array_loads_as_keys(tmp_path) -> None:
    keys = jax.random.split(jax.random.key(5), 3)
    cp.save_pytree(tmp_path / "c", {"k": jax.random.key_data(keys)})
    abstract = {"k": jax.ShapeDtypeStruct((3,), jax.random.key_dtype("threefry2x32"))}
    _same_keys(cp.load_pytree(tmp_path / "c", abstract)["k"], keys)


def test_another_implementation_or_a_non_key_is_a_mismatch(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", {"k": jax.random.key(0), "f": np.zeros(2, np.float32)})
    rbg = jax.random.key_dtype("rbg")
    with pytest.raises(cp.errors.TreeMismatchError, match=r"\['k'\] holds threefry2x32 keys"):
        cp.load_pytree(tmp_path / "c", {"k": jax.ShapeDtypeStruct((), rbg), "f": np.empty(2)})
    with pytest.raises(cp.errors.TreeMismatchError, match=r"\['f'\] was not saved as PRNG keys"):
        cp.load_pytree(tmp_path / "c", {"k": cp.PLACEHOLDER, "f": jax.ShapeDtypeStruct((), rbg)})


def test_storage_options_never_cast_keys(tmp_path) -> None:
    tree = {"k": jax.random.split(jax.random.key(4), 2), "w": jnp.arange(3.0)}
    options = cp.options.ArrayOptions(
        storage_options=cp.options.ArrayStorageOptions(dtype=jnp.bfloat16)
    )
    with cp.Context(array_options=options):
        cp.save_pytree(tmp_path / "c", tree)
    loaded = cp.load_pytree(tmp_path / "c")
    _same_keys(loaded["k"], tree["k"])
    assert loaded["w"].dtype == jnp.bfloat16


def test_async_save_of_keys_and_verify(tmp_path) -> None:
    keys = jax.random.split(jax.random.key(6), 5)
    response = cp.save_pytree_async(tmp_path / "c", {"k": keys})
    expected = jax.random.key_data(keys).copy()
    keys.delete()  # The save holds its own copy once save_pytree_async returns.
    response.result()
    loaded = cp.load_pytree(tmp_path / "c")["k"]
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(loaded)), np.asarray(expected))
    handler = cp.handlers.get("pytree")()
    assert cp._asyncio.run_sync(handler.verify(tmp_path / "c" / "pytree")) == []


def test_a_registry_without_the_key_handler_loads_key_data(tmp_path) -> None:
    from checkpointables_pytree import ArrayLeafHandler

    key = jax.random.key(8)
    cp.save_pytree(tmp_path / "c", {"k": key})
    registry = cp.serialization.LeafHandlerRegistry()
    registry.add(
        jax.Array,
        cp.serialization.AbstractShardedArray,
        ArrayLeafHandler,
        secondary_typestrs=("jax.Array",),
    )
    with cp.Context(pytree_options=cp.options.PyTreeOptions(leaf_handler_registry=registry)):
        loaded = cp.load_pytree(tmp_path / "c")["k"]
    np.testing.assert_array_equal(np.asarray(loaded), np.asarray(jax.random.key_data(key)))


def test_keys_of_a_deleted_array_or_a_custom_implementation_are_named(tmp_path) -> None:
    key = jax.random.key(0)
    key.delete()
    with pytest.raises(cp.errors.NoHandlerForObjectError, match=r"\['g'\]\['k'\].*deleted"):
        cp.save_pytree(tmp_path / "c", {"g": {"k": key}})
    toy = jax.extend.random.define_prng_impl(
        key_shape=(2,),
        seed=lambda seed: jnp.stack([seed, seed]).astype(jnp.uint32),
        split=lambda key, shape: jnp.broadcast_to(key, (*shape, 2)),
        random_bits=lambda key, bit_width, shape: jnp.zeros(shape, jnp.uint32),
        fold_in=lambda key, data: key,
        name="toy",
    )
    with pytest.raises(cp.errors.NoHandlerForObjectError, match=r"\['g'\]\['k'\].*not one JAX"):
        cp.save_pytree(tmp_path / "c", {"w": np.ones(2), "g": {"k": jax.random.key(0, impl=toy)}})
    assert os.listdir(tmp_path) == []


def test_keys_in_partial_saves_and_the_command_line(tmp_path, capsys) -> None:
    from checkpointables.cli import main as cli_main

    path = tmp_path / "c"
    keys = jax.random.split(jax.random.key(9, impl="rbg"), 2)
    cp.partial.save(path, {"rng": keys})
    cp.partial.save(path, {"w": np.ones(2)})  # The last partial save holds no keys.
    cp.partial.finalize(path)
    _same_keys(cp.load_pytree(path)["rng"], keys)
    assert cli_main(["inspect", str(path)]) == 0
    assert "['rng']: PRNGKeyMetadata shape=(2,) dtype=key<rbg>" in capsys.readouterr().out
    assert cli_main(["verify", str(path)]) == 0
