"""Trees of many small leaves: the batched paths (shards read straight from the data files).

Loads of more than a few dozen small arrays read their shards through
``_local_reads`` (the b-tree from ``ts.ocdbt.dump``, the bytes with
``preadv``) instead of one TensorStore read each; saves encode them here,
many to a transaction. Both must be exactly as safe as the one-by-one paths.
"""

from __future__ import annotations

import asyncio
import shutil

import checkpointables as cp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpointables_pytree import io, ocdbt, storage

from ..damage import copies_with_a_flipped_bit, flip

_RNG = np.random.default_rng(7)
# Sizes on both sides of OCDBT's 1 KiB inline limit, 1-D and 2-D, several dtypes.
TREE = {
    f"group_{g}": {
        f"w_{i:02d}": _RNG.standard_normal((3 + 37 * i,) if i % 2 else (i + 1, 9)).astype(
            np.float32 if i % 3 else np.float64
        )
        for i in range(30)
    }
    for g in range(4)
}
TREE["step"] = 12
TREE["scale"] = 0.5
TREE["counts"] = np.arange(5000, dtype=np.int16)
LEAVES = len(jax.tree_util.tree_leaves(TREE))


def _assert_equal(loaded, expected) -> None:
    flat_loaded, tree_loaded = jax.tree_util.tree_flatten(loaded)
    flat_expected, tree_expected = jax.tree_util.tree_flatten(expected)
    assert tree_loaded == tree_expected
    for a, b in zip(flat_loaded, flat_expected, strict=True):
        assert type(a) is type(b) or isinstance(b, np.ndarray)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if isinstance(b, np.ndarray):
            assert np.asarray(a).dtype == b.dtype


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("many") / "ckpt"
    cp.save_pytree(path, TREE)
    return path


def test_the_tree_is_big_enough_for_the_batched_read(saved) -> None:
    assert LEAVES > io.INLINE_READ_KEYS
    # ...and for the early read of the b-tree, so the damage tests below cover it too.
    metadata = (saved / "pytree" / "_METADATA").stat().st_size
    assert metadata > ocdbt.PREFETCH_METADATA_BYTES


def test_round_trip_numpy(saved) -> None:
    loaded = cp.load_pytree(saved)
    _assert_equal(loaded, TREE)
    # Loaded arrays are writable and aligned; those sharing a read buffer never overlap.
    array = loaded["group_1"]["w_07"]
    assert array.flags.writeable and array.flags.aligned
    array += 1
    loaded["group_1"]["w_07"] = TREE["group_1"]["w_07"]
    _assert_equal(loaded, TREE)  # Its neighbours are unchanged.


def test_round_trip_jax_and_abstract_tree(tmp_path) -> None:
    tree = jax.tree_util.tree_map(
        lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x, TREE
    )
    cp.save_pytree(tmp_path / "c", tree)
    _assert_equal(cp.load_pytree(tmp_path / "c"), tree)
    abstract = cp.pytree_metadata(tmp_path / "c").metadata
    _assert_equal(cp.load_pytree(tmp_path / "c", abstract), tree)


def test_async_save_and_load_of_many_leaves(tmp_path) -> None:
    response = cp.save_pytree_async(tmp_path / "c", TREE)
    response.result()
    _assert_equal(cp.load_pytree_async(tmp_path / "c").result(), TREE)


def test_partial_load_reads_only_what_is_asked(saved) -> None:
    abstract = {"group_2": {f"w_{i:02d}": np.empty(0) for i in range(0, 30, 3)}}
    abstract = jax.tree_util.tree_map(lambda _: None, abstract)
    wanted = {"group_2": {f"w_{i:02d}": TREE["group_2"][f"w_{i:02d}"] for i in range(0, 30, 3)}}
    abstract = jax.tree_util.tree_map(lambda x: np.empty(x.shape, x.dtype), wanted)
    _assert_equal(cp.load_pytree(saved, abstract, partial_load=True), wanted)


def _read_local(directory, keys) -> list:
    """The values of ``keys``: inline ones from the b-tree, the others read by ``_local_reads``."""
    found = asyncio.run(ocdbt.DatabaseIndex(directory).find(keys))
    values = [found.get(k.encode()) for k in keys]
    located = [v if isinstance(v, ocdbt.ValueLocation) else None for v in values]
    files = storage.OpenFiles()
    try:
        read = storage.read_values(files, located)
    finally:
        files.close()
    return [r if loc is not None else v for v, loc, r in zip(values, located, read, strict=True)]


def test_local_reads_match_tensorstore_reads(saved) -> None:
    directory = saved / "pytree"
    keys = [
        f"group_0.w_{i:02d}/c/" + "/".join("0" * TREE["group_0"][f"w_{i:02d}"].ndim)
        for i in range(30)
    ]
    keys += ["step/c", "counts/c/0", "no_such_array/c/0", keys[0]]  # A missing key, a repeat.
    found = _read_local(directory, keys)

    async def through_tensorstore():
        import tensorstore as ts

        kvstore = await ts.KvStore.open(ocdbt.kvstore_spec(directory), context=ocdbt.make_context())
        return await io.read_values(kvstore, keys)

    expected = asyncio.run(through_tensorstore())
    assert found[-2] is None  # Missing: left to TensorStore, which reports it.
    assert expected[-2] == b""
    for got, want in zip(found[:-2] + found[-1:], expected[:-2] + expected[-1:], strict=True):
        assert bytes(got) == want


def test_local_reads_share_aligned_buffers_of_bounded_size(saved) -> None:
    directory = saved / "pytree"
    keys = [
        f"group_{g}.w_{i:02d}/c/" + "/".join("0" * TREE[f"group_{g}"][f"w_{i:02d}"].ndim)
        for g in range(4)
        for i in range(30)
    ]
    found = _read_local(directory, keys)
    views = [v for v in found if isinstance(v, memoryview)]
    assert len(views) > 30  # Values too large to be inline in the b-tree.
    owners = {}
    for view in views:
        array = np.frombuffer(view, np.uint8)
        assert array.ctypes.data % 64 == 0 and array.flags.writeable
        owner = view.obj.base  # The buffer the slab allocated.
        owners[id(owner)] = owner
    assert len(owners) < len(views)  # Shared buffers, not one per value...
    assert all(o.nbytes <= storage.SLAB_BYTES + 64 for o in owners.values())  # ...bounded.


def _copy(saved, tmp_path, name):
    target = tmp_path / name
    shutil.copytree(saved, target)
    return target


def test_a_flipped_bit_in_any_file_never_returns_wrong_numbers(saved, tmp_path) -> None:
    for copy in copies_with_a_flipped_bit(saved, tmp_path, (1 / 3, 1 / 2, 2 / 3)):
        try:
            loaded = cp.load_pytree(copy)
        except (cp.errors.IntegrityError, cp.errors.MetadataError):
            continue
        _assert_equal(loaded, TREE)  # Unused bytes (padding): then exactly right.


@pytest.mark.parametrize("leaf", ["w_21", "w_23"])  # Out of line (inline ones are compressed).
def test_damaged_small_array_names_the_leaf(saved, tmp_path, leaf) -> None:
    copy = _copy(saved, tmp_path, "c")
    needle = TREE["group_3"][leaf].tobytes()[8:40]
    for path in sorted((copy / "pytree" / "d").iterdir()):
        raw = path.read_bytes()
        position = raw.find(needle)
        if position >= 0:
            flip(path, position + 4)
            break
    else:
        raise AssertionError("the array's bytes were not found in any data file")
    with pytest.raises(cp.errors.IntegrityError, match=rf"\['group_3'\]\['{leaf}'\]"):
        cp.load_pytree(copy)


def test_missing_data_files_are_integrity_errors(saved, tmp_path) -> None:
    copy = _copy(saved, tmp_path, "c")
    for path in (copy / "pytree" / "d").iterdir():
        if path.stat().st_size > 50_000:  # The file holding the out-of-line shards.
            path.unlink()
    with pytest.raises((cp.errors.IntegrityError, cp.errors.CheckpointError)):
        cp.load_pytree(copy)
