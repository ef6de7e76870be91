"""Saving and loading pytrees without an abstract tree: leaf types, containers, keys, layout."""

from __future__ import annotations

import collections
import json
import os

import checkpointables as cp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from checkpointables.checkpoint_metadata import read_checkpoint_metadata
from checkpointables_pytree import ArrayMetadata, NumpyMetadata, PyTreeHandler


def assert_same(loaded, original) -> None:
    """Same structure, same leaf types, same values."""
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(original)
    for a, b in zip(
        jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(original), strict=True
    ):
        assert type(a) is type(b) or (isinstance(a, jax.Array) and isinstance(b, jax.Array)), (a, b)
        if isinstance(b, np.ndarray | jax.Array):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:
            assert a == b


def test_mixed_tree_round_trip(tmp_path) -> None:
    tree = {
        "params": {"w": jnp.arange(12.0).reshape(3, 4), "b": np.ones(4, np.float32)},
        "step": 10,
        "lr": 0.25,
        "done": True,
        "name": "run-1 ünïcode",
        "history": [np.int32(3), np.float32(0.5), 7],
    }
    cp.save_pytree(tmp_path / "c", tree)
    assert_same(cp.load_pytree(tmp_path / "c"), tree)


def test_scalar_types_and_their_metadata(tmp_path) -> None:
    tree = {
        "int": 3,
        "float": 2.5,
        "bool": False,
        "complex": 1 + 2j,
        "f32": np.float32(1.5),
        "i64": np.int64(-7),
        "u8": np.uint8(200),
        "np_bool": np.bool_(True),
        "bf16": ml_dtypes.bfloat16(1.25),
    }
    cp.save_pytree(tmp_path / "c", tree)
    loaded = cp.load_pytree(tmp_path / "c")
    for key, value in tree.items():
        assert type(loaded[key]) is type(value), key
        assert loaded[key] == value, key
    metadata = cp.pytree_metadata(tmp_path / "c").metadata
    for key, value in tree.items():
        assert type(metadata[key]) is type(value) and metadata[key] == 0, key


def test_containers_and_empty_nodes(tmp_path) -> None:
    Pair = collections.namedtuple("Pair", ["first", "second"])
    tree = {
        "tuple": (np.arange(2), 3.0),
        "list": [np.full(2, i) for i in range(12)],  # indices sort as numbers, not strings
        "empty_dict": {},
        "empty_list": [],
        "empty_tuple": (),
        "none": None,
        "nested": {"deeper": {"x": 1}},
        "pair": Pair(np.zeros(2), 5),
    }
    cp.save_pytree(tmp_path / "c", tree)
    loaded = cp.load_pytree(tmp_path / "c")
    assert isinstance(loaded["tuple"], tuple)
    assert [int(a[0]) for a in loaded["list"]] == list(range(12))
    assert loaded["empty_dict"] == {} and loaded["empty_list"] == [] and loaded["empty_tuple"] == ()
    assert loaded["none"] is None
    assert loaded["nested"] == {"deeper": {"x": 1}}
    # Without an abstract tree a named tuple comes back as a dict of its fields (as in Orbax).
    assert set(loaded["pair"]) == {"first", "second"} and loaded["pair"]["second"] == 5


def test_a_bare_leaf_and_an_empty_tree(tmp_path) -> None:
    cp.save_pytree(tmp_path / "leaf", np.arange(5))
    np.testing.assert_array_equal(cp.load_pytree(tmp_path / "leaf"), np.arange(5))
    cp.save_pytree(tmp_path / "empty", {})
    assert cp.load_pytree(tmp_path / "empty") == {}


def test_zero_size_arrays_and_bytes(tmp_path) -> None:
    tree = {
        "np_empty": np.zeros((0,), np.float32),
        "np_empty_2d": np.zeros((3, 0), np.int16),
        "jax_empty": jnp.zeros((0, 4)),
        "bytes": b"\x00\xffbinary",
        "no_bytes": b"",
    }
    cp.save_pytree(tmp_path / "c", tree)
    assert_same(cp.load_pytree(tmp_path / "c"), tree)


@pytest.mark.parametrize(
    "dtype",
    [
        np.bool_,
        np.int8,
        np.uint16,
        np.int32,
        np.uint64,
        np.float16,
        np.float64,
        np.complex64,
        ml_dtypes.bfloat16,
        ml_dtypes.float8_e4m3fn,
    ],
)
def test_dtypes(tmp_path, dtype) -> None:
    value = (np.arange(24) % 5).astype(dtype).reshape(2, 3, 4)
    tree = {"np": value, "jax": jnp.asarray(value)}
    cp.save_pytree(tmp_path / "c", tree)
    assert_same(cp.load_pytree(tmp_path / "c"), tree)


def test_strided_and_big_endian_arrays(tmp_path) -> None:
    base = np.arange(48, dtype=np.float32).reshape(6, 8)
    tree = {"strided": base[::2, 1::3], "transposed": base.T, "big_endian": base.astype(">i4")}
    cp.save_pytree(tmp_path / "c", tree)
    loaded = cp.load_pytree(tmp_path / "c")
    for key, value in tree.items():
        np.testing.assert_array_equal(loaded[key], value)
    assert loaded["big_endian"].dtype == np.dtype("int32")


def test_arrays_larger_than_the_batched_path(tmp_path, mesh_4x2) -> None:
    big = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB
    sharded = jax.device_put(
        big, jax.sharding.NamedSharding(mesh_4x2, jax.sharding.PartitionSpec("x", "y"))
    )
    tree = {"np": big, "jax": sharded, "small": np.arange(3)}
    cp.save_pytree(tmp_path / "c", tree)
    loaded = cp.load_pytree(tmp_path / "c")
    np.testing.assert_array_equal(loaded["np"], big)
    np.testing.assert_array_equal(np.asarray(loaded["jax"]), big)


def test_sharded_array_without_abstract_loads_on_the_default_device(tmp_path, mesh_4x2) -> None:
    sharding = jax.sharding.NamedSharding(mesh_4x2, jax.sharding.PartitionSpec("x", None))
    array = jax.device_put(jnp.arange(32.0).reshape(8, 4), sharding)
    cp.save_pytree(tmp_path / "c", {"a": array})
    loaded = cp.load_pytree(tmp_path / "c")["a"]
    assert loaded.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])
    np.testing.assert_array_equal(np.asarray(loaded), np.asarray(array))


def test_keys_that_look_like_paths_neither_collide_nor_escape(tmp_path) -> None:
    tree = {
        "a.b": np.full(2, 1),
        "a": {"b": np.full(2, 2)},
        "x/../../escape": np.full(2, 3),
        "..": np.full(2, 4),
        "%2E": np.full(2, 5),
        "/abs": "s",
    }
    cp.save_pytree(tmp_path / "c", tree)
    loaded = cp.load_pytree(tmp_path / "c")
    assert_same(loaded, tree)
    # Nothing was written outside the checkpoint.
    assert sorted(os.listdir(tmp_path)) == ["c"]
    for root, dirs, _ in os.walk(tmp_path / "c"):
        for d in dirs:
            assert d not in ("..", "escape", "abs"), os.path.join(root, d)


def test_unsupported_leaves_are_named_and_nothing_is_written(tmp_path) -> None:
    tree = {"ok": np.zeros(2), "bad": {"thing": object(), "other": [1, {1, 2}]}}
    with pytest.raises(cp.errors.NoHandlerForObjectError) as info:
        cp.save_pytree(tmp_path / "c", tree)
    assert "['bad']['thing'] (object)" in str(info.value)
    assert "['bad']['other'][1] (set)" in str(info.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("leaf", "expected"),
    [
        (np.array(["a", "b"]), "dtype <U1"),
        (np.array([{}], dtype=object), "dtype object"),
        (2**70, "does not fit in 64 bits"),
        # TensorStore's zarr3 driver has int4 and int2 but no unsigned 4- or 2-bit types.
        (np.arange(4).astype(ml_dtypes.uint4), "uint4"),
        (jnp.arange(4, dtype=jnp.uint4), "uint4"),
        (np.zeros(2, ml_dtypes.uint2), "uint2"),
    ],
)
def test_leaves_that_cannot_be_stored_fail_before_writing(tmp_path, leaf, expected) -> None:
    with pytest.raises(cp.errors.NoHandlerForObjectError, match=expected) as info:
        cp.save_pytree(tmp_path / "c", {"group": {"leaf": leaf}})
    assert "['group']['leaf']" in str(info.value)
    assert os.listdir(tmp_path) == []


def test_keys_with_the_same_string_form_are_rejected(tmp_path) -> None:
    with pytest.raises(ValueError, match="same string form") as refused:
        cp.save_pytree(tmp_path / "c", {1: np.zeros(1), "1": np.ones(1)})
    assert "[1] and ['1']" in str(refused.value)  # Told apart, as inspect shows them.
    assert os.listdir(tmp_path) == []


def test_resolution_arrays_go_to_pytree_json_like_to_json(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "c", {"state": {"w": np.ones(2)}, "config": {"lr": 0.1}})
    recorded = read_checkpoint_metadata(tmp_path / "c")["item_handlers"]
    assert cp.handlers.get(recorded["state"]) is PyTreeHandler
    assert cp.handlers.get(recorded["config"]) is cp.handlers.get("json")
    loaded = cp.load_checkpointables(tmp_path / "c")
    np.testing.assert_array_equal(loaded["state"]["w"], np.ones(2))


def test_layout_is_orbax_layout_with_checksummed_chunks(tmp_path) -> None:
    tree = {"j": jnp.arange(4.0), "n": np.ones((2, 3)), "s": 3, "t": "text"}
    cp.save_pytree(tmp_path / "c", tree)
    pytree_dir = tmp_path / "c" / "pytree"
    assert {
        "_METADATA",
        "_sharding",
        "_strings.json",
        "manifest.ocdbt",
        "d",
        "array_metadatas",
    } <= set(os.listdir(pytree_dir))
    document = json.loads((pytree_dir / "_METADATA").read_text())
    assert document["use_ocdbt"] is True and document["use_zarr3"] is True
    types = {k: v["value_metadata"]["value_type"] for k, v in document["tree_metadata"].items()}
    assert types == {
        "('j',)": "jax.Array",
        "('n',)": "np.ndarray",
        "('s',)": "scalar",
        "('t',)": "string",
    }
    assert document["tree_metadata"]["('j',)"]["value_metadata"]["write_shape"] == [4]
    assert json.loads((pytree_dir / "_strings.json").read_text()) == {"t": "text"}
    kvstore = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{pytree_dir}"}).result()
    names = sorted(k.decode() for k in kvstore.list().result())
    assert names == ["j/c/0", "j/zarr.json", "n/c/0/0", "n/zarr.json", "s/c", "s/zarr.json"]
    for key in ("j/zarr.json", "n/zarr.json", "s/zarr.json"):
        zarr = json.loads(kvstore.read(key).result().value)
        (sharding,) = zarr["codecs"]
        assert sharding["name"] == "sharding_indexed"
        codecs = [c["name"] for c in sharding["configuration"]["codecs"]]
        assert codecs == ["bytes", "crc32c"]  # uncompressed by default, checksum after bytes


def test_metadata_describes_arrays_without_reading_them(tmp_path, mesh_4x2) -> None:
    sharding = jax.sharding.NamedSharding(mesh_4x2, jax.sharding.PartitionSpec("x", "y"))
    tree = {
        "j": jax.device_put(jnp.zeros((8, 4), jnp.bfloat16), sharding),
        "n": np.ones((2, 3), np.int8),
    }
    cp.save_pytree(tmp_path / "c", tree, custom_metadata={"run": 7})
    meta = cp.pytree_metadata(tmp_path / "c")
    assert meta.custom_metadata == {"run": 7}
    j, n = meta.metadata["j"], meta.metadata["n"]
    assert isinstance(j, ArrayMetadata) and isinstance(n, NumpyMetadata)
    assert (j.shape, j.dtype, j.sharding) == ((8, 4), jnp.bfloat16, sharding)
    assert j.sharding_metadata["sharding_type"] == "NamedSharding"
    assert j.storage.chunk_shape == (2, 2) and j.storage.write_shape == (2, 2)
    assert (n.shape, n.dtype, n.nbytes) == ((2, 3), np.int8, 6)
    assert not hasattr(n, "sharding")


def test_overwrite_and_checkpointable_name(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", {"a": np.zeros(2)}, checkpointable_name="state")
    cp.save_pytree(tmp_path / "c", {"a": np.ones(2)}, checkpointable_name="state", overwrite=True)
    np.testing.assert_array_equal(cp.load_pytree(tmp_path / "c")["a"], np.ones(2))
    assert sorted(os.listdir(tmp_path / "c")) == [
        "_CHECKPOINT_METADATA",
        "_CHECKSUMS",
        "commit_success.txt",
        "orbax.checkpoint",
        "state",
    ]


def test_string_leaves_past_a_metadata_file_are_refused_at_save(tmp_path, monkeypatch) -> None:
    # A load refuses such a _strings.json: the save must not commit one. (The bound is
    # lowered: 256 MiB of strings would take seconds here.)
    monkeypatch.setattr(cp.metadata_checksums, "MAX_FILE_BYTES", 5000)
    with pytest.raises(cp.errors.InvalidArgumentError, match="string leaves of this pytree"):
        cp.save_pytree(tmp_path / "c", {"s": "x" * 10_000})
    assert not (tmp_path / "c").exists()
    cp.save_pytree(tmp_path / "c", {"s": "x" * 1000})
    assert cp.load_pytree(tmp_path / "c") == {"s": "x" * 1000}
