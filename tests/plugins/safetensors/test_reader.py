"""cp.load_pytree / cp.pytree_metadata of safetensors files written by the safetensors package."""

from __future__ import annotations

import json
import os
import struct

import checkpointables as cp
import jax
import numpy as np
import pytest
from checkpointables_safetensors import import_safetensors
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import save_file

from ...special_files import KINDS, bounded, replace_with
from .files import BF16, model_tensors, random_bits, same_bits, write_sharded


def _flat(tree) -> dict[str, object]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p): v for p, v in flat}


def test_a_file_loads_as_nested_dicts_bit_for_bit(tmp_path) -> None:
    tensors = model_tensors()
    save_file(tensors, tmp_path / "model.safetensors", {"format": "pt"})
    loaded = cp.load_pytree(tmp_path / "model.safetensors")
    assert sorted(loaded["model"]["layers"]) == ["0", "1"]
    flat = _flat(loaded)
    assert sorted(flat) == sorted(tensors)
    for name, value in tensors.items():
        # JAX without 64-bit types cannot hold float64/int64: those come back as NumPy.
        wide = value.dtype in (np.float64, np.int64)
        assert isinstance(flat[name], np.ndarray if wide else jax.Array), name
        assert same_bits(flat[name], value), name


def test_metadata_gives_shapes_and_dtypes_without_reading_data(tmp_path) -> None:
    save_file(model_tensors(), tmp_path / "model.safetensors", {"format": "pt", "note": "x"})
    meta = cp.pytree_metadata(tmp_path / "model.safetensors")
    assert meta.custom_metadata == {"format": "pt", "note": "x"}
    layer = meta.metadata["model"]["layers"]["0"]["self_attn"]["q_proj"]["weight"]
    assert layer == jax.ShapeDtypeStruct((32, 32), BF16)
    assert meta.metadata["model"]["step"] == jax.ShapeDtypeStruct((), np.int64)
    # The metadata is a valid abstract tree.
    loaded = cp.load_pytree(tmp_path / "model.safetensors", meta)
    assert same_bits(loaded["model"]["norm"]["weight"], model_tensors()["model.norm.weight"])


def test_metadata_of_a_huge_sparse_file_reads_no_data(tmp_path) -> None:
    # 64 GiB of data that was never written (a sparse file): only the header is read.
    save_file({"w": np.zeros((8, 1024), np.float32)}, tmp_path / "w.safetensors")
    with safe_open(tmp_path / "w.safetensors", "numpy") as f:
        assert f.keys() == ["w"]
    raw = (tmp_path / "w.safetensors").read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + length])
    header["w"] = {"dtype": "F32", "shape": [1 << 24, 1024], "data_offsets": [0, 1 << 36]}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + (1 << 36))
    meta = cp.pytree_metadata(path)
    assert meta.metadata == {"w": jax.ShapeDtypeStruct((1 << 24, 1024), np.float32)}


def test_a_sharded_set_loads_from_its_directory_or_index(tmp_path) -> None:
    tensors = model_tensors()
    index = write_sharded(tmp_path / "hub", tensors)
    for path in (tmp_path / "hub", index):
        flat = _flat(cp.load_pytree(path))
        assert sorted(flat) == sorted(tensors)
        assert all(same_bits(flat[n], v) for n, v in tensors.items())
    meta = cp.pytree_metadata(tmp_path / "hub")
    assert meta.custom_metadata == {"format": "pt"}
    assert _flat(meta.metadata)["model.embed_tokens.weight"].shape == (64, 32)


def test_a_directory_without_index_loads_all_its_files(tmp_path) -> None:
    save_file({"a.x": np.ones(3, np.float32)}, tmp_path / "one.safetensors")
    save_file({"b": np.zeros(2, np.int8)}, tmp_path / "two.safetensors")
    loaded = cp.load_pytree(tmp_path)
    assert set(loaded) == {"a", "b"} and loaded["a"]["x"].shape == (3,)
    save_file({"b": np.zeros(2, np.int8)}, tmp_path / "three.safetensors")
    with pytest.raises(cp.errors.MetadataError, match="'b' is in both"):
        cp.load_pytree(tmp_path)


def test_loads_onto_an_8_device_mesh_with_resharding_and_casts(tmp_path) -> None:
    assert jax.device_count() == 8
    stored = {
        "rows": np.arange(64 * 40, dtype=np.float32).reshape(64, 40),
        "grid": random_bits((16, 24), BF16, 5),
        "columns": np.arange(6 * 48, dtype=np.int32).reshape(6, 48),
        "replicated": np.arange(10, dtype=np.float32),
        "cast": random_bits((8, 8), BF16, 6),
    }
    save_file(stored, tmp_path / "m.safetensors")
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    abstract = {
        "rows": jax.ShapeDtypeStruct((64, 40), np.float32, sharding=NamedSharding(mesh, P("x"))),
        "grid": jax.ShapeDtypeStruct((16, 24), BF16, sharding=NamedSharding(mesh, P("x", "y"))),
        "columns": jax.ShapeDtypeStruct(
            (6, 48), np.int32, sharding=NamedSharding(mesh, P(None, ("x", "y")))
        ),
        "replicated": jax.ShapeDtypeStruct((10,), np.float32, sharding=NamedSharding(mesh, P())),
        "cast": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("y"))),
    }
    loaded = cp.load_pytree(tmp_path / "m.safetensors", abstract)
    for name, value in loaded.items():
        assert value.sharding == abstract[name].sharding, name
        assert value.dtype == abstract[name].dtype
        expected = stored[name].astype(abstract[name].dtype)
        assert same_bits(value, expected), name
        for shard in value.addressable_shards:
            assert same_bits(shard.data, expected[shard.index]), name
    assert len(loaded["grid"].addressable_shards) == 8


def test_abstract_leaves_choose_numpy_scalars_lists_and_skips(tmp_path) -> None:
    save_file(model_tensors(), tmp_path / "m.safetensors")
    meta = cp.pytree_metadata(tmp_path / "m.safetensors").metadata
    layers = meta["model"].pop("layers")
    abstract = {
        "model": {
            **meta["model"],
            "layers": [layers["0"], layers["1"]],  # A list: matched as layers.0, layers.1.
            "step": 0,  # A Python int.
            "rotary": {"inv_freq": cp.PLACEHOLDER},
            "norm": {"weight": np.empty((32,), np.float32)},  # NumPy, cast from float16.
            "mask": None,  # Skipped.
            "empty": cp.PLACEHOLDER,  # Skipped.
        }
    }
    loaded = cp.load_pytree(tmp_path / "m.safetensors", abstract)
    assert loaded["model"]["step"] == 7 and type(loaded["model"]["step"]) is int
    scalar = cp.load_pytree(
        tmp_path / "m.safetensors", {"model": {"step": np.float32(0)}}, partial_load=True
    )
    assert type(scalar["model"]["step"]) is np.float32 and scalar["model"]["step"] == 7
    norm = loaded["model"]["norm"]["weight"]
    assert type(norm) is np.ndarray and norm.dtype == np.float32
    assert np.array_equal(norm, model_tensors()["model.norm.weight"].astype(np.float32))
    assert isinstance(loaded["model"]["layers"], list)
    assert loaded["model"]["mask"] is None and loaded["model"]["empty"] is cp.PLACEHOLDER


def test_partial_load_and_mismatches_name_the_key_paths(tmp_path) -> None:
    save_file(model_tensors(), tmp_path / "m.safetensors")
    path = tmp_path / "m.safetensors"
    just_norm = {"model": {"norm": {"weight": jax.ShapeDtypeStruct((32,), np.float16)}}}
    with pytest.raises(cp.errors.TreeMismatchError, match="leaves out 9 tensors"):
        cp.load_pytree(path, just_norm)
    loaded = cp.load_pytree(path, just_norm, partial_load=True)
    assert loaded["model"]["norm"]["weight"].shape == (32,)
    with pytest.raises(cp.errors.TreeMismatchError, match=r"model\.nowhere"):
        cp.load_pytree(path, {"model": {"nowhere": jax.ShapeDtypeStruct((1,), np.float32)}})
    with pytest.raises(cp.errors.TreeMismatchError, match=r"shape \(31,\).*shape \(32,\)"):
        cp.load_pytree(
            path,
            {"model": {"norm": {"weight": jax.ShapeDtypeStruct((31,), np.float16)}}},
            partial_load=True,
        )


def test_two_leaves_naming_one_tensor_are_a_mismatch_naming_both(tmp_path) -> None:
    # Export refuses this tree (one name, two leaves); a load must not fill both from "a.b".
    save_file({"a.b": np.arange(3, dtype=np.float32)}, tmp_path / "m.safetensors")
    abstract = {"a.b": np.empty(3, np.float32), "a": {"b": np.empty(3, np.float32)}}
    with pytest.raises(cp.errors.TreeMismatchError) as raised:
        cp.load_pytree(tmp_path / "m.safetensors", abstract)
    assert "['a.b']" in str(raised.value) and "['a']['b']" in str(raised.value)
    # Skipping one of them loads the other.
    loaded = cp.load_pytree(tmp_path / "m.safetensors", {**abstract, "a": {"b": None}})
    assert np.array_equal(loaded["a.b"], np.arange(3)) and loaded["a"]["b"] is None


def test_async_load(tmp_path) -> None:
    save_file({"a": np.arange(5.0)}, tmp_path / "m.safetensors")
    response = cp.load_pytree_async(tmp_path / "m.safetensors")
    assert np.array_equal(response.result()["a"], np.arange(5.0))


def _damaged(tmp_path, name: str, edit) -> str:
    tensors = {"a": np.arange(10, dtype=np.float32), "b": np.ones((3, 4))}
    save_file(tensors, tmp_path / "ok.safetensors")
    raw = (tmp_path / "ok.safetensors").read_bytes()
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(edit(raw))
    return str(path)


def _with_header(raw: bytes, change) -> bytes:
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + length])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + raw[8 + length :]


@pytest.mark.parametrize(
    ("name", "edit", "says"),
    [
        ("truncated", lambda raw: raw[:-8], "file not fully covered"),
        ("tiny", lambda raw: raw[:5], "header too small"),
        ("empty", lambda raw: b"", "header too small"),
        ("huge_header", lambda raw: struct.pack("<Q", 1 << 40) + raw[8:], "header too large"),
        ("bad_json", lambda raw: raw[:8] + b"{" * 16 + raw[24:], "invalid JSON"),
        (
            "huge_tensor",  # A header claiming 1 TiB for "b" in a file of a few hundred bytes.
            lambda raw: _with_header(
                raw, lambda h: h["b"].update(shape=[1 << 37], data_offsets=[40, 40 + (1 << 40)])
            ),
            "invalid offset for tensor `b`",
        ),
    ],
)
def test_damaged_files_are_refused_naming_the_file(tmp_path, name, edit, says) -> None:
    path = _damaged(tmp_path, name, edit)
    for call in (cp.load_pytree, cp.pytree_metadata):
        with pytest.raises(cp.errors.CheckpointError, match=says) as raised:
            call(path)
        assert path in str(raised.value)
        assert isinstance(raised.value, cp.errors.MetadataError)


def test_damaged_index_and_missing_files(tmp_path) -> None:
    index = write_sharded(tmp_path / "hub", model_tensors())
    os.remove(tmp_path / "hub" / "model-00002-of-00002.safetensors")
    with pytest.raises(cp.errors.CheckpointNotFoundError, match="model-00002-of-00002"):
        cp.load_pytree(index)
    with open(index) as f:
        content = json.load(f)
    content["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"
    content["weight_map"] = {k: "model-00001-of-00002.safetensors" for k in content["weight_map"]}
    with open(index, "w") as f:
        json.dump(content, f)
    with pytest.raises(cp.errors.MetadataError, match="do not belong together"):
        cp.load_pytree(tmp_path / "hub")
    with open(index, "w") as f:
        f.write("{not json")
    with pytest.raises(cp.errors.MetadataError, match="not a valid safetensors index"):
        cp.load_pytree(index)
    with pytest.raises(cp.errors.CheckpointNotFoundError):
        cp.load_pytree(tmp_path / "missing.safetensors")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("replaced", ["model-00002-of-00002.safetensors", "index"])
def test_a_pipe_for_a_file_of_a_set_is_refused_at_once(tmp_path, replaced, kind) -> None:
    index = write_sharded(tmp_path / "hub", model_tensors())
    file = index if replaced == "index" else os.fspath(tmp_path / "hub" / replaced)
    replace_with(file, kind)
    for call in (cp.load_pytree, cp.pytree_metadata):
        for path in (index, tmp_path / "hub"):
            _, outcome = bounded(lambda call=call, path=path: call(path), tmp_path)
            if replaced == "index" and path != index:
                continue  # The directory holds no index file then: the shards alone load.
            assert isinstance(outcome, cp.errors.CheckpointError), outcome
            assert os.path.basename(file) in str(outcome)


def test_a_checkpoint_named_like_safetensors_is_still_a_checkpoint(tmp_path) -> None:
    cp.save_pytree(tmp_path / "x.safetensors", {"a": np.arange(3)})
    assert np.array_equal(cp.load_pytree(tmp_path / "x.safetensors")["a"], np.arange(3))
    with pytest.raises(ValueError, match="drop checkpointable_name"):
        save_file({"a": np.ones(1)}, tmp_path / "f.safetensors")
        cp.load_pytree(tmp_path / "f.safetensors", checkpointable_name="pytree")


def test_a_tensor_named_twice_in_a_header_is_refused(tmp_path) -> None:
    # The package keeps the last entry (int32 here); a reader keeping the first sees floats.
    header = (
        b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},'
        b'"w":{"dtype":"I32","shape":[4],"data_offsets":[0,16]}}'
    )
    path = tmp_path / "twice.safetensors"
    data = np.arange(4, dtype=np.float32).tobytes()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    for read in (cp.load_pytree, cp.pytree_metadata):
        with pytest.raises(cp.errors.MetadataError, match=r"twice.safetensors: .*\['w'\] more"):
            read(path)


def test_an_abstract_leaf_of_no_array_type_is_the_librarys_type_error(tmp_path) -> None:
    save_file({"w": np.arange(4, dtype=np.float32)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(cp.errors.InvalidArgumentTypeError, match=r"\['w'\]: abstract leaves"):
        cp.load_pytree(tmp_path / "m.safetensors", {"w": "a string"})


def test_float8_tensors_load_bit_for_bit_whole_and_onto_a_mesh(tmp_path) -> None:
    # The package's NumPy reader has no float8 type: these are read from their bytes.
    import ml_dtypes

    bits = np.random.default_rng(0).integers(0, 256, (16, 8), dtype=np.uint8)
    tensors = {
        "e4m3": bits.view(ml_dtypes.float8_e4m3fn),
        "e5m2": bits.view(ml_dtypes.float8_e5m2),
        "empty": np.zeros((0, 4), ml_dtypes.float8_e4m3fn),
    }
    save_file(tensors, str(tmp_path / "fp8.safetensors"))
    loaded = cp.load_pytree(tmp_path / "fp8.safetensors")
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype and loaded[name].shape == value.shape
        assert np.asarray(loaded[name]).tobytes() == value.tobytes()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    sharding = NamedSharding(mesh, P("x", "y"))
    abstract = {
        n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for n, v in tensors.items()
    }
    abstract["empty"] = jax.ShapeDtypeStruct((0, 4), tensors["empty"].dtype)
    on_mesh = cp.load_pytree(tmp_path / "fp8.safetensors", abstract)
    for shard in on_mesh["e5m2"].addressable_shards:
        assert np.asarray(shard.data).tobytes() == tensors["e5m2"][shard.index].tobytes()


def _raw_file(path, header: dict, data: bytes) -> str:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return str(path)


@pytest.mark.parametrize("mesh", [False, True])
def test_bool_bytes_other_than_0_and_1_are_refused(tmp_path, mesh) -> None:
    # NumPy and JAX keep such bytes: the array would say a == True is False where it is 1.
    header = {"m": {"dtype": "BOOL", "shape": [8], "data_offsets": [0, 8]}}
    path = _raw_file(tmp_path / "b.safetensors", header, bytes([0, 1, 0, 1, 1, 0, 7, 255]))
    abstract = None
    if mesh:
        sharding = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("x",)), P("x"))
        abstract = {"m": jax.ShapeDtypeStruct((8,), np.bool_, sharding=sharding)}
    with pytest.raises(cp.errors.MetadataError, match=r"b.safetensors: tensor 'm' is BOOL .* 7"):
        cp.load_pytree(path, abstract)
    with pytest.raises(cp.errors.MetadataError, match="is BOOL"):
        import_safetensors(path, tmp_path / "ckpt")
    assert not os.path.exists(tmp_path / "ckpt")
    good = _raw_file(tmp_path / "g.safetensors", header, bytes([0, 1, 0, 1, 1, 0, 1, 0]))
    assert cp.load_pytree(good)["m"].tolist() == [0, 1, 0, 1, 1, 0, 1, 0]


@pytest.mark.parametrize("shape", [[0, 1 << 62], [1 << 62, 0], [0, 1 << 40, 1 << 40]])
def test_an_empty_tensor_of_an_unindexable_shape_is_refused(tmp_path, shape) -> None:
    header = {"e": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}
    path = _raw_file(tmp_path / "e.safetensors", header, b"")
    for read in (cp.load_pytree, cp.pytree_metadata):
        with pytest.raises(cp.errors.MetadataError, match=r"e.safetensors: tensor 'e' has shape"):
            read(path)
    with pytest.raises(cp.errors.MetadataError, match="has shape"):
        import_safetensors(path, tmp_path / "ckpt")
    header["e"]["shape"] = [0, 1 << 40]  # Empty, and indexable: loads.
    assert cp.load_pytree(_raw_file(tmp_path / "ok.safetensors", header, b""))["e"].size == 0


def test_an_index_naming_a_tensor_twice_is_refused(tmp_path) -> None:
    index = write_sharded(tmp_path / "hub", model_tensors())
    with open(index) as f:
        text = f.read()
    # A second entry for a tensor, pointing at the other file (json would keep the last).
    twice = text.replace(
        '"weight_map": {',
        '"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors", ',
        1,
    )
    assert twice != text
    with open(index, "w") as f:
        f.write(twice)
    for read in (cp.load_pytree, cp.pytree_metadata):
        with pytest.raises(
            cp.errors.MetadataError, match=r"index.json lists \['model.norm.weight'\] more"
        ):
            read(tmp_path / "hub")


def test_an_index_nested_too_deeply_is_a_metadata_error_everywhere(tmp_path, capsys) -> None:
    from checkpointables import cli

    index = tmp_path / "idx" / "model.safetensors.index.json"
    index.parent.mkdir()
    index.write_text('{"weight_map":' + "[" * 100_000 + "]" * 100_000 + "}")
    for read in (cp.load_pytree, cp.pytree_metadata):
        with pytest.raises(cp.errors.MetadataError, match="nested too deeply") as raised:
            read(tmp_path / "idx")
        assert str(index) in str(raised.value)
    for command in (
        ["inspect", str(tmp_path / "idx")],
        ["import", str(index), str(tmp_path / "ck")],
    ):
        assert cli.main(command) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "nested too deeply" in err, err
        assert "Traceback" not in err


def test_an_index_larger_than_any_index_is_refused_unread(tmp_path) -> None:
    index = write_sharded(tmp_path / "hub", model_tensors())
    with open(index, "r+b") as f:  # Sparse: costs no disk, and must cost no memory.
        f.truncate(cp.metadata_checksums.MAX_FILE_BYTES + 1)
    with pytest.raises(cp.errors.MetadataError, match=r"holds more than 268,435,456 bytes"):
        cp.load_pytree(tmp_path / "hub")


def test_a_directory_of_two_indexes_names_one_to_give_any_caller(tmp_path, capsys) -> None:
    from checkpointables import cli

    index = write_sharded(tmp_path / "hub", model_tensors())
    os.link(index, tmp_path / "hub" / "other.safetensors.index.json")
    with pytest.raises(cp.errors.MetadataError, match="holds several indexes") as raised:
        cp.load_pytree(tmp_path / "hub")
    assert f"e.g. {index}." in str(raised.value) and "cp.load_pytree" not in str(raised.value)
    assert cli.main(["import", str(tmp_path / "hub"), str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert f"Give the path of one instead of the directory, e.g. {index}." in err
