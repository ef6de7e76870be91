"""Uncompressed b-tree nodes decoded here agree with TensorStore's own decoding (``dump``)."""

from __future__ import annotations

import asyncio
import os
import shutil

import checkpointables as cp
import checkpointables_pytree
import numpy as np
import pytest
import tensorstore as ts
from checkpointables_pytree import ocdbt
from etils import epath

from ..damage import flip
from ..ocdbt_cases import as_dump

_RNG = np.random.default_rng(3)
_UNCOMPRESSED = {"compression": None}
_ZSTD = {"compression": {"id": "zstd"}}


def _kvstore(directory, config):
    spec = {"driver": "ocdbt", "base": {"driver": "file", "path": os.fspath(directory) + "/"}}
    return ts.KvStore.open({**spec, "config": config}).result()


def _write(store, values) -> None:
    with ts.Transaction() as transaction:
        for key, value in values.items():
            store.with_transaction(transaction)[key] = value


def _values(count: int) -> dict[str, bytes]:
    """Keys sharing prefixes of several lengths; values inline (short) and in data files."""
    values = {f"layer{i // 7}/w{i}/c/0": bytes([i % 251]) * (90 + 37 * i) for i in range(count)}
    values.update({f"layer{i}/zarr.json": b"{}" * i for i in range(0, count // 7, 3)})
    values["a"] = b""
    values["\xff/last"] = b"end"
    return values


def _node_bytes(directory, location: str) -> bytes:
    base, relative, offset, length = ocdbt.split_location(location)
    with open(os.path.join(directory, base + relative), "rb") as f:
        f.seek(offset)
        return f.read(length)


def _all_nodes(directory):
    """Every node of the latest b-tree: ``(location, dump of it)``, root first."""
    base = ts.KvStore.open({"driver": "file", "path": os.fspath(directory) + "/"}).result()
    manifest = ocdbt.dump(base)
    latest = max(manifest["versions"], key=lambda v: v["generation_number"])
    pending, nodes = [latest["root"]["location"]], []
    while pending:
        location = pending.pop()
        node = ocdbt.dump(base, location)
        nodes.append((location, node))
        if node["height"] > 0:
            pending.extend(e["location"] for e in node["entries"])
    return nodes


@pytest.mark.parametrize("max_node_bytes", [300, 100_000_000])  # Deep, and all in the root.
def test_every_node_decodes_as_tensorstore_decodes_it(tmp_path, max_node_bytes) -> None:
    config = {**_UNCOMPRESSED, "max_inline_value_bytes": 64}
    config["max_decoded_node_bytes"] = max_node_bytes
    _write(_kvstore(tmp_path, config), _values(120))
    nodes = _all_nodes(tmp_path)
    assert (len(nodes) > 1) == (max_node_bytes == 300)
    kinds = set()
    for location, dumped in nodes:
        base = ocdbt.split_location(location)[0]
        decoded = ocdbt.decode(_node_bytes(tmp_path, location), base)
        if dumped["height"] == 0:
            assert as_dump(decoded) == dumped["entries"], location
            kinds.update("inline_value" in e for e in dumped["entries"])
        else:
            expected = [
                {k: e.get(k, b"") for k in ("key", "subtree_common_prefix", "location")}
                for e in dumped["entries"]
            ]
            assert decoded == expected, location
    assert kinds == {True, False}  # Both inline values and values in data files were decoded.


def test_compressed_nodes_are_left_to_tensorstore(tmp_path) -> None:
    _write(_kvstore(tmp_path, _ZSTD), _values(30))
    (location, _), *_ = _all_nodes(tmp_path)
    assert ocdbt.decode(_node_bytes(tmp_path, location), "") is None


@pytest.mark.parametrize("config", [_UNCOMPRESSED, _ZSTD], ids=["uncompressed", "zstd"])
def test_the_index_finds_the_same_values_in_both_kinds_of_nodes(tmp_path, config) -> None:
    sizes = {"max_inline_value_bytes": 64, "max_decoded_node_bytes": 400}
    values = _values(150)
    _write(_kvstore(tmp_path, {**config, **sizes}), values)
    index = ocdbt.DatabaseIndex(tmp_path)
    found = asyncio.run(index.find([*values, "layer0/absent"]))
    assert set(found) == {k.encode() for k in values}
    for key, value in found.items():
        if isinstance(value, ocdbt.ValueLocation):
            with open(value.file, "rb") as f:
                f.seek(value.offset)
                value = f.read(value.length)
        assert value == values[key.decode()], key
    decoded = [n["entries"] for n in index._nodes.values() if n["height"] == 0]
    own = {type(e) is ocdbt.LeafNode for e in decoded}
    assert own == {config is _UNCOMPRESSED}  # Only uncompressed nodes are decoded here.


@pytest.mark.parametrize(
    "data",
    [b"", b"\x0c\xdb\x20\xde" + b"\x00" * 20, b"not a node at all, not at all"],
)
def test_what_is_not_a_node_is_an_error(data) -> None:
    with pytest.raises(ValueError):
        ocdbt.decode(data, "")


def _uncompressed_copy(saved, target):
    """``saved`` with its database rewritten by TensorStore with uncompressed nodes."""
    shutil.copytree(saved, target)
    database = target / "pytree"
    shutil.rmtree(database / "d")
    os.remove(database / "manifest.ocdbt")
    old = _kvstore(saved / "pytree", {})
    values = {k: old[k] for k in old.list().result()}
    _write(_kvstore(database, {**_UNCOMPRESSED, "max_inline_value_bytes": 1024}), values)
    checkpointables_pytree.record_checksums_again(target)  # Rewritten on purpose.
    return target


def test_a_checkpoint_with_uncompressed_nodes_loads_and_damage_is_caught(tmp_path) -> None:
    # 100 arrays: the load locates its values in the b-tree, rather than asking TensorStore.
    tree = {f"w{i}": _RNG.standard_normal(50 + i).astype(np.float32) for i in range(100)}
    cp.save_pytree(tmp_path / "orig", tree)
    copy = _uncompressed_copy(tmp_path / "orig", tmp_path / "plain")
    (location, root), *_ = _all_nodes(copy / "pytree")
    assert root["height"] == 0
    loaded = cp.load_pytree(copy)
    assert all(np.array_equal(loaded[k], v) for k, v in tree.items())
    _, relative, offset, length = ocdbt.split_location(location)
    for n, at in enumerate([offset + 20, offset + length // 2, offset + length - 2]):
        damaged = shutil.copytree(copy, tmp_path / f"damaged{n}")
        flip(damaged / "pytree" / relative, at)
        with pytest.raises(cp.errors.IntegrityError):
            cp.load_pytree(damaged)


def test_nodes_of_merged_databases_name_the_files_of_each(tmp_path) -> None:
    # A merge (multi-process saves) points the root's b-tree into the processes' databases:
    # their data files' paths start with the base path of the node that names them.
    config = {**_UNCOMPRESSED, "max_inline_value_bytes": 16, "max_decoded_node_bytes": 400}
    values = {}
    for process in (1, 2):
        (tmp_path / f"ocdbt.process_{process}").mkdir()
        own = {f"p{process}/w{i}/c/0": bytes([process, i]) * (50 + i) for i in range(30)}
        _write(_kvstore(tmp_path / f"ocdbt.process_{process}", config), own)
        values.update(own)
    _write(_kvstore(tmp_path, {**_UNCOMPRESSED, **ocdbt.OCDBT_CONFIG}), {"root/c/0": b"r" * 2000})
    values["root/c/0"] = b"r" * 2000
    sources = [ocdbt.Source(epath.Path(tmp_path / f"ocdbt.process_{p}")) for p in (1, 2)]
    ocdbt.merge_into(epath.Path(tmp_path), sources)
    index = ocdbt.DatabaseIndex(tmp_path)
    found = asyncio.run(index.find(list(values)))
    assert {type(n["entries"]) for n in index._nodes.values() if n["height"] == 0} == {
        ocdbt.LeafNode
    }
    files = set()
    for key, location in found.items():
        with open(location.file, "rb") as f:
            f.seek(location.offset)
            assert f.read(location.length) == values[key.decode()], key
        files.add(os.path.relpath(location.file, tmp_path).split(os.sep)[0])
    assert set(found) == {k.encode() for k in values}
    assert files == {"d", "ocdbt.process_1", "ocdbt.process_2"}


def test_a_node_decoded_before_is_reused_only_for_the_same_bytes(tmp_path) -> None:
    # Two databases of the same keys and value sizes: their roots have the same length.
    roots = []
    for name, fill in (("a", 1), ("b", 2)):
        values = {k: bytes([fill]) * len(v) for k, v in _values(40).items()}
        _write(_kvstore(tmp_path / name, _UNCOMPRESSED), values)
        (location, _), *_ = _all_nodes(tmp_path / name)
        roots.append((location, _node_bytes(tmp_path / name, location)))
    (location, first), (_, second) = roots
    assert len(first) == len(second) and first != second
    decoded = ocdbt.decoded(first, location)
    assert ocdbt.decoded(first, location) is decoded  # Decoded once.
    # Other bytes at a location seen before (a checkpoint written again) are decoded anew.
    again = ocdbt.decoded(second, location)["entries"]
    base = ocdbt.split_location(location)[0]
    assert as_dump(again) == as_dump(ocdbt.decode(second, base))
    assert as_dump(again) != as_dump(decoded["entries"])
