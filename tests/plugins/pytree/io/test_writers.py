"""Arrays written by TensorStore's zarr3 driver, committed by several OCDBT writers, merged
into one database at the end.

The writer encodes plain arrays itself; arrays in inner chunks (here: 8 MiB
chunks, ``ArrayStorageOptions.chunk_byte_size``), compressed ones and int4
go through the driver. A save whose such arrays fill more than one group
(``LARGE_GROUP_BYTES``) commits the groups through several
``ocdbt.writer_<i>`` databases and merges them into the pytree's database.
These tests save enough data for that and check the result against every
reader: this library, ``verify`` (which reads through TensorStore's zarr3
driver), Orbax, partial saves, and damage.
"""

from __future__ import annotations

import shutil

import checkpointables as cp
import jax
import numpy as np
import pytest
from checkpointables_pytree import io, ocdbt
from etils import epath
from orbax.checkpoint import v1 as ocp_v1

from ..damage import flip

# Three groups' worth of large arrays (each just over a group), and small ones.
BIG_ELEMENTS = ocdbt.LARGE_GROUP_BYTES // 4 + 1024


def _tree() -> dict:
    rng = np.random.default_rng(5)
    return {
        "params": {f"w{i}": rng.standard_normal(BIG_ELEMENTS, dtype=np.float32) for i in range(3)},
        "embed": jax.numpy.arange(1000.0).reshape(10, 100),
        "bias": np.arange(7, dtype=np.int64),
        "step": 3,
    }


def _assert_equal(loaded, expected) -> None:
    flat_loaded = jax.tree_util.tree_leaves(loaded)
    flat_expected = jax.tree_util.tree_leaves(expected)
    assert len(flat_loaded) == len(flat_expected)
    for a, b in zip(flat_loaded, flat_expected, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# Arrays over 8 MiB are split in inner chunks: the zarr3 driver writes them (the others go
# into the database the fast path writes, whose count of writers the tests check).
INNER_CHUNKS = cp.Context(
    array_options=cp.options.ArrayOptions(
        storage_options=cp.options.ArrayStorageOptions(chunk_byte_size=8 << 20),
        ocdbt_fast_path=True,
    )
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("writers") / "c"
    tree = _tree()
    with INNER_CHUNKS:
        cp.save_pytree(path, tree)
    return path, tree


@pytest.mark.fast_path
def test_groups_are_committed_by_several_writers_and_merged(saved) -> None:
    path, tree = saved
    writers = sorted(p.name for p in (path / "pytree").glob(ocdbt.WRITER_PREFIX + "*"))
    assert len(writers) == 3, writers
    # The pytree's own database holds every key; the writers' data files hold the big chunks.
    found = _locate(path / "pytree", [f"params.w{i}/c/0" for i in range(3)])
    assert sorted({location.file.split("/")[-3] for location in found.values()}) == writers
    _assert_equal(cp.load_pytree(path), tree)


def _locate(directory, keys) -> dict[str, ocdbt.ValueLocation]:
    return cp._asyncio.run_sync(ocdbt.locate(directory, keys))


# Orbax warns when it restores a jax.Array from the `_sharding` file.
@pytest.mark.orbax
@pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring:UserWarning")
def test_verify_and_orbax_read_the_merged_database(saved) -> None:
    path, tree = saved
    handler = cp.handlers.get("pytree")()
    # verify also reads every large chunk through TensorStore's zarr3 driver.
    assert cp._asyncio.run_sync(handler.verify(path / "pytree")) == []
    _assert_equal(ocp_v1.load(path), tree)


def test_a_flipped_bit_in_a_writers_data_file_names_the_leaf(saved, tmp_path) -> None:
    path, _ = saved
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    location = _locate(copy / "pytree", ["params.w1/c/0"])["params.w1/c/0"]
    flip(epath.Path(location.file), location.offset + location.length // 2)
    with pytest.raises(cp.errors.IntegrityError, match="w1"):
        cp.load_pytree(copy)


@pytest.mark.orbax
@pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring:UserWarning")
def test_partial_saves_of_large_arrays_finalize_into_one_checkpoint(tmp_path) -> None:
    tree = _tree()
    root = tmp_path / "partial"
    with INNER_CHUNKS:
        cp.partial.save(root, {"params": tree["params"]})
        cp.partial.save(root, {"embed": tree["embed"], "bias": tree["bias"], "step": tree["step"]})
    cp.partial.finalize(root)
    writers = f"{cp.partial.SOURCE_PREFIX}*/**/{ocdbt.WRITER_PREFIX}*"
    assert list((root / "pytree").glob(writers))
    _assert_equal(cp.load_pytree(root), tree)
    _assert_equal(ocp_v1.load(root), tree)


@pytest.mark.fast_path
def test_plain_large_arrays_are_written_without_the_driver(tmp_path) -> None:
    # On a local disk plain arrays up to DIRECT_BYTES go to the database's own data files.
    path = tmp_path / "c"
    tree = _tree()
    tree["params"] = {k: v[: io.DIRECT_BYTES // 4] for k, v in tree["params"].items()}
    cp.save_pytree(path, tree)
    assert not list((path / "pytree").glob(ocdbt.WRITER_PREFIX + "*"))
    found = _locate(path / "pytree", [f"params.w{i}/c/0" for i in range(3)])
    assert {location.file.split("/")[-2] for location in found.values()} == {"d"}
    handler = cp.handlers.get("pytree")()
    assert cp._asyncio.run_sync(handler.verify(path / "pytree")) == []
    _assert_equal(cp.load_pytree(path), tree)
