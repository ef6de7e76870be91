"""Databases written by ``_direct_database``, read (and written on top of) by TensorStore."""

from __future__ import annotations

import numpy as np
import pytest
import tensorstore as ts
from checkpointables_pytree import ocdbt


def _write(directory, values: dict[str, bytes], file_bytes=100_000, fixed=(), **options) -> int:
    """Writes ``values`` as a new database in data files of about ``file_bytes`` (``fixed``
    keys' values given to the layout, the others when filled); returns how many files."""
    layout = ocdbt.DatabaseLayout(
        list(values),
        [len(v) for v in values.values()],
        [v if k in fixed else None for k, v in values.items()],
        file_bytes=file_bytes,
        **options,
    )
    # Two parts each: a value is written from several buffers.
    halves = [(len(v) // 2, v) for k, v in values.items() if k not in fixed]
    filled = [[np.frombuffer(v[:half], np.uint8), v[half:]] for half, v in halves]
    names = layout.file_names()
    files = [layout.data_file(n, names, filled) for n in range(layout.data_files)]
    btree, manifest = layout.btree_file(names, filled)
    for file in [*files, btree, ocdbt.DataFile(ocdbt.MANIFEST_FILE, [manifest])]:
        ocdbt.write_local_file(str(directory), file, flush=False)
    return len(files) + 1


def _values(count: int) -> dict[str, bytes]:
    rng = np.random.default_rng(count)
    # Sizes on both sides of MAX_INLINE_VALUE_BYTES (inline in the b-tree, or in a data file).
    sizes = rng.integers(0, 3 * ocdbt.MAX_INLINE_VALUE_BYTES, count)
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


@pytest.mark.parametrize("max_node_bytes", [ocdbt.MAX_NODE_BYTES, 20_000])
def test_tensorstore_reads_every_key(tmp_path, max_node_bytes) -> None:
    values = _values(3000)
    assert _write(tmp_path, values, max_node_bytes=max_node_bytes) > 1
    _assert_holds(_open(tmp_path), values)
    versions = ts.ocdbt.dump(ts.KvStore.open(f"file://{tmp_path}/").result()).result()["versions"]
    # A small node limit makes a root over several leaves.
    assert versions[-1]["root_height"] == (max_node_bytes < 1_000_000)
    assert versions[-1]["root"]["statistics"]["num_keys"] == len(values)


@pytest.mark.parametrize("max_node_bytes", [ocdbt.MAX_NODE_BYTES, 20_000])
def test_tensorstore_commits_on_top(tmp_path, max_node_bytes) -> None:
    values = _values(500)
    _write(tmp_path, values, max_node_bytes=max_node_bytes)
    store = _open(tmp_path, **ocdbt.OCDBT_CONFIG)
    added = {"a": b"first", "zzz": b"last", "layer_7/c/1x": b"between"}
    for key, value in added.items():
        store.write(key, value).result()
    _assert_holds(_open(tmp_path), values | added)


def test_a_data_file_of_more_parts_than_one_writev_takes(tmp_path) -> None:
    values = {f"k{i:04}": bytes([i % 251]) * 1500 for i in range(1200)}  # 2,400 parts.
    assert _write(tmp_path, values, file_bytes=1 << 30) == 2  # One data file, the b-tree's.
    _assert_holds(_open(tmp_path), values)


def test_a_database_of_inline_values_only(tmp_path) -> None:
    values = {"b": b"2", "a": b"1", "": b"empty key"}
    assert _write(tmp_path, values) == 1
    _assert_holds(_open(tmp_path), values)


@pytest.mark.parametrize("max_node_bytes", [ocdbt.MAX_NODE_BYTES, 20_000])
def test_one_layout_filled_with_new_values_each_time(tmp_path, max_node_bytes) -> None:
    first = _values(600)
    # Fixed values, inline or not, are the layout's: the same in every database.
    fixed = [k for i, k in enumerate(first) if i % 4 == 0]
    second = {k: v if k in fixed else bytes(reversed(v)) for k, v in first.items()}
    layout = ocdbt.DatabaseLayout(
        list(first),
        [len(v) for v in first.values()],
        [v if k in fixed else None for k, v in first.items()],
        file_bytes=50_000,
        max_node_bytes=max_node_bytes,
    )
    for n, values in enumerate([first, second]):
        filled = [[v] for k, v in values.items() if k not in fixed]
        names = layout.file_names()
        files = [layout.data_file(i, names, filled) for i in range(layout.data_files)]
        btree, manifest = layout.btree_file(names, filled)
        manifest_file = ocdbt.DataFile(ocdbt.MANIFEST_FILE, [manifest])
        for file in [*files, btree, manifest_file]:
            ocdbt.write_local_file(str(tmp_path / str(n)), file, flush=False)
    _assert_holds(_open(tmp_path / "0"), first)
    _assert_holds(_open(tmp_path / "1"), second)


def test_data_files_grow_from_the_first_size(tmp_path) -> None:
    values = {f"k{i:03}": bytes([i]) * 10_000 for i in range(70)}
    # Files of at most 10, 20, 40, 80 KB: 1 + 2 + 4 + 8 values, then the rest.
    layout = ocdbt.DatabaseLayout(
        list(values), [10_000] * 70, [None] * 70, file_bytes=80_000, first_file_bytes=10_000
    )
    assert [layout.needs(n) for n in range(layout.data_files)] == [
        1,
        3,
        7,
        15,
        23,
        31,
        39,
        47,
        55,
        63,
        70,
    ]
    assert _write(tmp_path, values, file_bytes=80_000, first_file_bytes=10_000) == 12
    _assert_holds(_open(tmp_path), values)


def test_a_key_given_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        ocdbt.DatabaseLayout(["w/c/0", "w/c/0"], [1, 1], [b"x", None], file_bytes=10)


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
        ocdbt.write_rest(f.fileno(), parts, written)
    assert path.read_bytes() == whole
