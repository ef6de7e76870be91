"""Small arrays read and checked together (``_small_reads``): the same arrays, the same errors."""

from __future__ import annotations

import os
import shutil

import checkpointables as cp
import crc32c
import jax
import numpy as np
import pytest
from checkpointables_pytree import io, storage, zarr3

# Counting its calls patches the function where the reader finds it.
from checkpointables_pytree.io import ArrayRead, StoredArray, _small_reads
from checkpointables_pytree.ocdbt import ValueLocation

from ....special_files import bounded
from ..damage import flip
from ..ocdbt.test_btree_nodes import _uncompressed_copy

# Tests of the OCDBT fast path itself: on even where CI turns it off.
pytestmark = pytest.mark.fast_path

_RNG = np.random.default_rng(11)
# Shapes and dtypes of many kinds, on both sides of OCDBT's 1 KiB inline limit.
_DTYPES = [np.float32, np.float64, np.int8, np.uint16, np.bool_, np.float16, np.complex64]
TREE = {
    f"layer_{i:03d}": (_RNG.standard_normal((i % 5 + 1, 7 * i + 1)) * 50).astype(
        _DTYPES[i % len(_DTYPES)]
    )
    for i in range(90)
}
TREE["scalar"] = np.array(3.5, np.float32)  # 0-d.
TREE["empty"] = np.zeros((0, 3), np.float32)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("small") / "ckpt"
    cp.save_pytree(path, TREE)
    return path


@pytest.fixture
def taken(monkeypatch) -> list[int]:
    """How many arrays each call of ``io.read_small`` took."""
    counts: list[int] = []
    original = io.read_small

    def counting(files, smalls, verify):
        counts.append(len(smalls))
        return original(files, smalls, verify)

    monkeypatch.setattr(_small_reads, "read_small", counting)
    return counts


def _assert_equal(loaded) -> None:
    assert loaded.keys() == TREE.keys()
    for key, value in TREE.items():
        assert loaded[key].dtype == value.dtype and loaded[key].shape == value.shape, key
        np.testing.assert_array_equal(loaded[key], value)
        assert loaded[key].flags.writeable
        assert loaded[key].ctypes.data % 64 == 0 or not loaded[key].size


@pytest.mark.parametrize("nodes", ["zstd", "uncompressed"])
def test_small_arrays_load_exactly_through_the_batch(saved, tmp_path, taken, nodes) -> None:
    path = saved if nodes == "zstd" else _uncompressed_copy(saved, tmp_path / "plain")
    _assert_equal(cp.load_pytree(path))
    assert sum(taken) == len(TREE) - 1  # All but the empty array (no shard at all).
    # With an abstract tree of the stored shapes (and as jax.Arrays) too.
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in TREE.items()}
    loaded = cp.load_pytree(path, abstract)
    for key, value in TREE.items():  # Without x64, jax holds 64-bit numbers in 32 bits.
        expected = np.asarray(jax.numpy.asarray(value))
        np.testing.assert_array_equal(np.asarray(loaded[key]), expected, err_msg=key)


def _shard_position(copy, array: np.ndarray) -> tuple[os.PathLike, int]:
    for path in sorted((copy / "pytree" / "d").iterdir()):
        position = path.read_bytes().find(array.tobytes())
        if position >= 0:
            return path, position
    raise AssertionError("the array's bytes were not found in any data file")


@pytest.mark.parametrize(
    ("where", "problem"),
    [(0, "CRC-32C does not match"), (4, "layout"), (12, "layout"), (22, "layout")],
)
def test_a_damaged_shard_names_its_leaf(saved, tmp_path, where, problem) -> None:
    # Byte ``where`` after the data: its CRC-32C, the shard index, the index's CRC-32C.
    copy = shutil.copytree(saved, tmp_path / "c")
    array = TREE["layer_080"]
    path, position = _shard_position(copy, array)
    flip(path, position + array.nbytes + where)
    with pytest.raises(cp.errors.IntegrityError, match=rf"\['layer_080'\].*{problem}"):
        cp.load_pytree(copy)
    if where == 0:  # Not checking checksums skips the data's CRC-32C, never the layout.
        with cp.Context(array_options=cp.options.ArrayOptions(verify_checksums=False)):
            np.testing.assert_array_equal(cp.load_pytree(copy)["layer_080"], array)


def _small(name: str, value) -> io.Small:
    stored = StoredArray((4,), np.dtype(np.float32), (4,), direct=True)
    size = value.length if isinstance(value, ValueLocation) else len(value)
    return io.Small(ArrayRead(name, name, stored, convert=lambda p: p[0]), value, size)


def test_values_a_file_cannot_hold_are_left_to_tensorstore(tmp_path) -> None:
    data = np.arange(4, dtype=np.float32)
    shard = zarr3.encode_shard(data.tobytes(), crc32c.crc32c(data))
    (tmp_path / "values").write_bytes(shard * 2)
    where = os.fspath(tmp_path / "values")
    files = storage.OpenFiles()
    try:
        inline = _small("inline", shard)
        whole = [_small("a", ValueLocation(where, 0, len(shard))), inline]
        assert all(np.array_equal(a, data) for a in io.read_small(files, whole, True))
        beyond = _small("b", ValueLocation(where, len(shard) + 8, len(shard)))  # Cut short.
        missing = _small("c", ValueLocation(where + ".gone", 0, len(shard)))
        assert io.read_small(files, [*whole, beyond], True) is None
        assert io.read_small(files, [missing, inline], True) is None
    finally:
        files.close()


def test_arrays_share_buffers_of_bounded_size(saved) -> None:
    loaded = cp.load_pytree(saved)
    owners = {id(a.base): a.base for a in loaded.values() if a.base is not None}
    assert len(owners) < len(loaded) / 2
    assert all(o.nbytes <= storage.SLAB_BYTES + 64 for o in owners.values())


def test_a_data_file_swapped_for_a_pipe_after_the_load_began_is_refused(tmp_path) -> None:
    """The check of the whole checkpoint at the start of a load cannot see a later swap: the
    reads that open data files themselves refuse a pipe too, instead of blocking."""
    pipe = tmp_path / "d" / "data"
    pipe.parent.mkdir()
    os.mkfifo(pipe)
    files = storage.OpenFiles()
    calls = {
        "read_range": lambda: storage.read_range(os.fspath(pipe), 0, 8),
        "read_values": lambda: storage.read_values(files, [ValueLocation(str(pipe), 0, 8)]),
    }
    try:
        for name, call in calls.items():
            _, outcome = bounded(call, tmp_path)
            assert isinstance(outcome, cp.errors.IntegrityError), (name, outcome)
            assert f"{pipe} is a named pipe" in str(outcome)
    finally:
        files.close()
