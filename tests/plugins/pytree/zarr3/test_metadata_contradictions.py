"""An array's ``zarr.json`` that contradicts what ``_METADATA`` recorded of it.

This library records every array's shape and dtype; Orbax records, of a
``jax.Array``, the ``write_shape`` (each saved shard's shape), and nothing of a
NumPy array. A ``zarr.json`` edited against those records (checksums recorded
again for ours, as someone editing on purpose would) is a ``MetadataError`` naming
the leaf, its ``zarr.json`` and ``_METADATA``, on every read path: loads (fast
path, driver, host-memory budget), ``pytree_metadata`` where it reads the
``zarr.json`` (Orbax's), and ``checkpointables verify``.
"""

from __future__ import annotations

import json
import shutil

import checkpointables as cp
import checkpointables_pytree
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from checkpointables import _verification
from checkpointables_pytree import ocdbt, zarr3

from ....metadata_edits import without_metadata_checksums
from .test_edited_zarr_json import PATHS  # Fast path, driver, host-memory budget.

A = np.arange(12, dtype=np.float32).reshape(3, 4)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``{kind: (checkpoint, pytree directory name)}``: Orbax's (``a`` a jax.Array), ours
    compressed (read by the zarr3 driver) and ours plain (read by the fast path)."""
    from orbax.checkpoint import v1 as ocp_v1

    root = tmp_path_factory.mktemp("saved")
    ocp_v1.save(root / "orbax", {"a": jnp.asarray(A)})
    with cp.Context(array_options=cp.options.ArrayOptions(use_compression=True)):
        cp.save_pytree(root / "compressed", {"a": A})
    cp.save_pytree(root / "plain", {"a": A})
    return {
        k: (root / k, "state" if k == "orbax" else "pytree")
        for k in ("orbax", "compressed", "plain")
    }


def _edited(saved, kind: str, target, **changes):
    """A copy of ``kind`` whose ``a/zarr.json`` has ``changes``; ours vouched for again."""
    source, pytree = saved[kind]
    shutil.copytree(source, target)
    kvstore = ts.KvStore.open(
        ocdbt.kvstore_spec(target / pytree), context=ocdbt.make_context()
    ).result()
    document = json.loads(kvstore.read("a/zarr.json").result().value)
    document.update(changes)
    kvstore.write("a/zarr.json", json.dumps(document).encode()).result()
    if kind != "orbax":
        checkpointables_pytree.record_checksums_again(target)
    return target, target / pytree


def _assert_names_both_files(message: str, pytree) -> None:
    for part in ("['a']", f"{pytree / 'a' / 'zarr.json'}", f"{pytree / '_METADATA'}"):
        assert part in message, message
    assert "contradict each other" in message and "restore the checkpoint from a copy" in message


def _problems(checkpoint) -> list[str]:
    return [f.problem for f in _verification.verify_checkpoint(checkpoint) if f.problem]


CHANGES = pytest.mark.parametrize(
    "changes",
    [{"data_type": "int32", "fill_value": 0}, {"shape": [2, 4]}],
    ids=["dtype", "smaller_shape"],
)


@pytest.mark.orbax
@CHANGES
def test_verify_names_both_files_where_ours_contradict(saved, tmp_path, changes) -> None:
    checkpoint, pytree = _edited(saved, "compressed", tmp_path / "c", **changes)
    (problem,) = _problems(checkpoint)
    _assert_names_both_files(problem, pytree)
    # What pytree_metadata reports is _METADATA's record (it reads no zarr.json of ours).
    assert cp.pytree_metadata(checkpoint).metadata["a"].shape == (3, 4)


@pytest.mark.orbax
@CHANGES
def test_loads_raise_a_metadata_error_naming_both_files_where_ours_contradict(
    saved, tmp_path, changes
) -> None:
    checkpoint, pytree = _edited(saved, "compressed", tmp_path / "c", **changes)
    for context in PATHS.values():
        with context, pytest.raises(cp.errors.MetadataError) as raised:
            cp.load_pytree(checkpoint)
        _assert_names_both_files(str(raised.value), pytree)


def _unchecksummed_plain(saved, tmp_path):
    # No recorded checksum of _METADATA: loads compare every zarr.json with it first.
    checkpoint, pytree = _edited(saved, "plain", tmp_path / "c", shape=[2, 4])
    without_metadata_checksums(checkpoint)
    return checkpoint, pytree


def test_verify_names_both_files_for_ours_unchecksummed(saved, tmp_path) -> None:
    checkpoint, pytree = _unchecksummed_plain(saved, tmp_path)
    (problem,) = _problems(checkpoint)
    _assert_names_both_files(problem, pytree)


def test_the_fast_path_raises_a_metadata_error_for_ours_unchecksummed(saved, tmp_path) -> None:
    checkpoint, pytree = _unchecksummed_plain(saved, tmp_path)
    with pytest.raises(cp.errors.MetadataError) as raised:
        cp.load_pytree(checkpoint)
    _assert_names_both_files(str(raised.value), pytree)


@pytest.mark.orbax
def test_verify_refuses_orbax_shape_that_no_longer_holds_its_write_shape(saved, tmp_path) -> None:
    # Every chunk keeps its size ([3, 4]: the edge chunk is padded), so nothing else notices.
    checkpoint, pytree = _edited(saved, "orbax", tmp_path / "c", shape=[2, 4])
    (problem,) = _problems(checkpoint)
    assert "write_shape [3, 4]" in problem
    _assert_names_both_files(problem, pytree)


@pytest.mark.orbax
def test_loads_and_metadata_refuse_orbax_shape_that_no_longer_holds_its_write_shape(
    saved, tmp_path
) -> None:
    checkpoint, pytree = _edited(saved, "orbax", tmp_path / "c", shape=[2, 4])
    calls = [lambda: cp.pytree_metadata(checkpoint)]
    for context in PATHS.values():
        calls.append(lambda context=context: _load(checkpoint, context))
    for call in calls:
        with pytest.raises(cp.errors.MetadataError, match=r"write_shape \[3, 4\]") as raised:
            call()
        _assert_names_both_files(str(raised.value), pytree)


def _load(checkpoint, context: cp.Context):
    with context:
        return cp.load_pytree(checkpoint)


@pytest.mark.orbax
def test_orbax_dtype_of_the_same_size_is_the_documented_limit(saved, tmp_path) -> None:
    # Orbax records no dtype, nor a checksum of its data: float32 read as int32 loads
    # other values. docs/integrity.md says so; this test notices if that ever changes.
    checkpoint, _ = _edited(saved, "orbax", tmp_path / "c", data_type="int32", fill_value=0)
    loaded = cp.load_pytree(checkpoint)["a"]
    assert loaded.dtype == np.int32 and loaded.shape == (3, 4)
    np.testing.assert_array_equal(np.asarray(loaded).view(np.float32), A)


@pytest.mark.parametrize(
    ("shape", "chunks", "write", "said"),
    [
        ((3, 4), (3, 4), (3, 4), None),
        ((8, 4), (2, 2), (2, 4), None),  # Orbax's subchunks divide the shard.
        ((2, 4), (3, 4), (3, 4), "does not fit"),
        ((3, 4), (3, 4), (3,), "does not fit"),
        ((8, 4), (3, 4), (4, 4), "must divide"),
        ((), (), (), None),
    ],
)
def test_write_shape_checks(shape, chunks, write, said) -> None:
    problem = zarr3.record_contradiction(shape, np.float32, chunks, write_shape=write)
    assert (problem is None) if said is None else (said in problem)
    assert zarr3.record_contradiction(shape, np.float32, chunks, recorded=(shape, "f4")) is None
    assert "int32" in zarr3.record_contradiction(shape, np.int32, chunks, recorded=(shape, "f4"))
