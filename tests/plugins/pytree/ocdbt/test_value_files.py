"""Large arrays of a local checkpoint are read straight from the database's data files."""

from __future__ import annotations

import asyncio
import os
import shutil

import checkpointables as cp
import jax
import numpy as np
import pytest
import tensorstore as ts
from checkpointables_pytree import ocdbt
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..opens import load_recording_opens

# Tests of the OCDBT fast path itself: on even where CI turns it off.
pytestmark = pytest.mark.fast_path

_RNG = np.random.default_rng(7)


def _kvstore(directory, config=None):
    spec = {"driver": "ocdbt", "base": {"driver": "file", "path": os.fspath(directory) + "/"}}
    if config:
        spec["config"] = config
    return ts.KvStore.open(spec).result()


def _bytes_at(location: ocdbt.ValueLocation) -> bytes:
    with open(location.file, "rb") as f:
        f.seek(location.offset)
        return f.read(location.length)


def test_locations_in_a_deep_btree_hold_exactly_the_values(tmp_path) -> None:
    # Tiny nodes force a b-tree several levels deep, with common key prefixes.
    store = _kvstore(tmp_path, {"max_inline_value_bytes": 16, "max_decoded_node_bytes": 300})
    values = {f"layer{i // 7}/w{i}/c/0": bytes([i]) * (100 + i) for i in range(80)}
    values["tiny"] = b"inline"
    with ts.Transaction() as transaction:
        for key, value in values.items():
            store.with_transaction(transaction)[key] = value
    wanted = [*values, "absent/key"]
    found = asyncio.run(ocdbt.locate(tmp_path, wanted))
    assert set(found) == set(values) - {"tiny"}  # Inline and missing keys have no location.
    for key, location in found.items():
        assert _bytes_at(location) == values[key], key


def test_locations_follow_merged_databases(tmp_path) -> None:
    (tmp_path / "ocdbt.process_1").mkdir()
    config = {"max_inline_value_bytes": 1024, "max_decoded_node_bytes": 100_000_000}
    _kvstore(tmp_path, config)["a/c/0"] = b"a" * 5000
    _kvstore(tmp_path / "ocdbt.process_1", config)["b/c/0"] = b"b" * 6000
    ocdbt.merge_into(epath.Path(tmp_path), [ocdbt.Source(epath.Path(tmp_path / "ocdbt.process_1"))])
    found = asyncio.run(ocdbt.locate(tmp_path, ["a/c/0", "b/c/0"]))
    assert "ocdbt.process_1" in found["b/c/0"].file
    assert _bytes_at(found["a/c/0"]) == b"a" * 5000
    assert _bytes_at(found["b/c/0"]) == b"b" * 6000


def test_one_index_serves_several_lookups_and_bytes_keys(tmp_path) -> None:
    store = _kvstore(tmp_path, {"max_inline_value_bytes": 16, "max_decoded_node_bytes": 300})
    values = {f"layer{i // 7}/w{i}/c/0": bytes([i]) * (100 + i) for i in range(40)}
    with ts.Transaction() as transaction:
        for key, value in values.items():
            store.with_transaction(transaction)[key] = value
    index = ocdbt.DatabaseIndex(tmp_path)
    index.prefetch()
    index.prefetch()  # Once only.
    keys = list(values)
    first = asyncio.run(index.find(keys[:20]))
    nodes = len(index._nodes)
    second = asyncio.run(index.find([k.encode() for k in keys[20:]]))
    assert set(first) | set(second) == {k.encode() for k in keys}
    for key, location in {**first, **second}.items():
        assert _bytes_at(location) == values[key.decode()]
    again = asyncio.run(index.find(keys[:20]))
    assert again == first and len(index._nodes) >= nodes  # Nodes read once, reused.


@pytest.mark.parametrize(
    "text",
    [
        "value::../../etc/d/x:0:10",  # Outside the database.
        "btreenode::d/x:0:10",  # Not a value.
        "value::d/x:ten:10",
        "garbage",
    ],
)
def test_unusable_locations_are_refused(text) -> None:
    assert ocdbt.parse_location(text, "/ckpt/pytree") is None


def test_parsed_location() -> None:
    parsed = ocdbt.parse_location("value:ocdbt.process_1/:d/abc:24:1000", "/ckpt/pytree")
    assert parsed == ocdbt.ValueLocation("/ckpt/pytree/ocdbt.process_1/d/abc", 24, 1000)


def _sharded(shape, spec, mesh_shape=(4, 2)):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(mesh_shape), ("x", "y"))
    data = _RNG.standard_normal(shape).astype(np.float32)
    return data, jax.device_put(data, NamedSharding(mesh, spec))


@pytest.mark.parametrize(
    ("shape", "spec"),
    [
        ((4096, 64), PartitionSpec("x")),  # Row chunks: read in place.
        ((512, 512), PartitionSpec("x", "y")),  # Blocks: read, then copied into place.
        ((300_000,), PartitionSpec()),  # One chunk.
    ],
)
def test_large_arrays_are_read_from_the_data_files(tmp_path, shape, spec) -> None:
    data, array = _sharded(shape, spec)
    cp.save_pytree(tmp_path / "c", {"w": array, "n": data[:10]})
    loaded, opened = load_recording_opens(tmp_path / "c")
    assert opened, "the direct read path was not taken"
    np.testing.assert_array_equal(np.asarray(loaded["w"]), data)
    np.testing.assert_array_equal(loaded["n"], data[:10])
    # Restored onto another mesh and dtype through an abstract tree.
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    target = jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    again = cp.load_pytree(tmp_path / "c", {"w": target, "n": np.empty_like(data[:10])})
    np.testing.assert_array_equal(np.asarray(again["w"]), data)


def _largest_data_file(path):
    files = (path / "pytree" / "d").iterdir()
    return max(files, key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("spec", [PartitionSpec("x"), PartitionSpec("x", "y")])
def test_a_flipped_bit_in_a_large_sharded_array_names_it(tmp_path, spec) -> None:
    _, array = _sharded((1024, 512), spec)
    cp.save_pytree(tmp_path / "c", {"weights": array, "ok": 3})
    damaged = _largest_data_file(tmp_path / "c")
    raw = bytearray(damaged.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    damaged.write_bytes(bytes(raw))
    with pytest.raises(cp.errors.IntegrityError, match=r"\['weights'\]"):
        cp.load_pytree(tmp_path / "c")


def test_a_truncated_data_file_is_an_integrity_error(tmp_path) -> None:
    data = _RNG.standard_normal(400_000)
    cp.save_pytree(tmp_path / "c", {"big": data})
    damaged = _largest_data_file(tmp_path / "c")
    os.truncate(damaged, damaged.stat().st_size // 2)
    with pytest.raises(cp.errors.IntegrityError, match=r"\['big'\]"):
        cp.load_pytree(tmp_path / "c")


def test_copied_checkpoints_read_their_own_files(tmp_path) -> None:
    data = _RNG.standard_normal(400_000)
    cp.save_pytree(tmp_path / "c", {"big": data})
    shutil.copytree(tmp_path / "c", tmp_path / "copy")
    shutil.rmtree(tmp_path / "c")
    loaded, opened = load_recording_opens(tmp_path / "copy")
    assert opened
    np.testing.assert_array_equal(loaded["big"], data)
