"""Databases written by ``_direct_database``, read (and written on top of) by TensorStore."""

from __future__ import annotations

import numpy as np
import pytest
import tensorstore as ts
from checkpointables_pytree import _direct_database, _ocdbt, _ocdbt_format


def _write(directory, values: dict[str, bytes], file_bytes=100_000, **options) -> int:
    """Writes ``values`` as a new database in data files of about ``file_bytes``; returns how
    many."""
    database = _direct_database.DirectDatabase(**options)
    files = []
    for key, value in values.items():
        half = len(value) // 2  # Two parts: a value is written from several buffers.
        database.put(key, [np.frombuffer(value[:half], np.uint8), value[half:]])
        if database.pending_bytes > file_bytes:
            files.append(database.seal())
    last, manifest = database.finish()
    files.append(last)
    for file in files:
        _direct_database._write_local_file(str(directory), file, flush=False)
    _direct_database._write_local_file(
        str(directory), _direct_database.DataFile(_ocdbt.MANIFEST_FILE, [manifest]), flush=False
    )
    return len(files)


def _values(count: int) -> dict[str, bytes]:
    rng = np.random.default_rng(count)
    # Sizes on both sides of MAX_INLINE_VALUE_BYTES (inline in the b-tree, or in a data file).
    sizes = rng.integers(0, 3 * _direct_database.MAX_INLINE_VALUE_BYTES, count)
    return {f"layer_{i}/c/{i % 3}": rng.bytes(int(n)) for i, n in enumerate(sizes)}


def _open(directory, **config) -> ts.KvStore:
    spec = {"driver": "ocdbt", "base": f"file://{directory}/"}
    if config:
        spec["config"] = config
    return ts.KvStore.open(spec).result()


def _assert_holds(store: ts.KvStore, values: dict[str, bytes]) -> None:
    assert sorted(k.decode() for k in store.list().result()) == sorted(values)
    for key, value in values.items():
        assert store.read(key).result().value == value, key


@pytest.mark.parametrize("max_node_bytes", [_ocdbt_format.MAX_NODE_BYTES, 20_000])
def test_tensorstore_reads_every_key(tmp_path, max_node_bytes) -> None:
    values = _values(3000)
    assert _write(tmp_path, values, max_node_bytes=max_node_bytes) > 1
    _assert_holds(_open(tmp_path), values)
    versions = ts.ocdbt.dump(ts.KvStore.open(f"file://{tmp_path}/").result()).result()["versions"]
    # A small node limit makes a root over several leaves.
    assert versions[-1]["root_height"] == (max_node_bytes < 1_000_000)
    assert versions[-1]["root"]["statistics"]["num_keys"] == len(values)


@pytest.mark.parametrize("max_node_bytes", [_ocdbt_format.MAX_NODE_BYTES, 20_000])
def test_tensorstore_commits_on_top(tmp_path, max_node_bytes) -> None:
    values = _values(500)
    _write(tmp_path, values, max_node_bytes=max_node_bytes)
    store = _open(tmp_path, **_ocdbt.OCDBT_CONFIG)
    added = {"a": b"first", "zzz": b"last", "layer_7/c/1x": b"between"}
    for key, value in added.items():
        store.write(key, value).result()
    _assert_holds(_open(tmp_path), values | added)


def test_a_data_file_of_more_parts_than_one_writev_takes(tmp_path) -> None:
    values = {f"k{i:04}": bytes([i % 251]) * 1500 for i in range(1200)}  # 2,400 parts.
    assert _write(tmp_path, values, file_bytes=1 << 30) == 1
    _assert_holds(_open(tmp_path), values)


def test_a_database_of_inline_values_only(tmp_path) -> None:
    values = {"b": b"2", "a": b"1", "": b"empty key"}
    assert _write(tmp_path, values) == 1
    _assert_holds(_open(tmp_path), values)


def test_a_key_put_twice_is_refused() -> None:
    database = _direct_database.DirectDatabase()
    database.put("w/c/0", [b"x"])
    database.put("w/c/0", [b"y"])
    with pytest.raises(ValueError, match="twice"):
        database.finish()


def test_an_existing_database_is_never_overwritten(tmp_path) -> None:
    _write(tmp_path, {"a": b"1"})
    with pytest.raises(FileExistsError):
        _write(tmp_path, {"a": b"2"})
    _assert_holds(_open(tmp_path), {"a": b"1"})


@pytest.mark.parametrize("written", [0, 3, 4, 9, 15])
def test_a_short_write_is_resumed_where_it_stopped(tmp_path, written) -> None:
    parts = [b"abcd", np.frombuffer(b"efghijk", np.uint8), b"lmnop"]  # 16 bytes.
    whole = b"abcdefghijklmnop"
    path = tmp_path / "file"
    with open(path, "wb") as f:
        f.write(whole[:written])  # As if os.writev had stopped after `written` bytes.
        f.flush()
        _direct_database._write_rest(f.fileno(), parts, written)
    assert path.read_bytes() == whole
