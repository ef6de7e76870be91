"""Metadata that was crafted or mangled: what a load must refuse with a library error.

Most edits here are caught by the checksums recorded at commit. Each is also
made with those checksums recomputed (as someone editing files on purpose
could) or removed (as in checkpoints written by Orbax): then the form of the
metadata, and its agreement with the array store, are what catch it.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import shutil

import checkpointables as cp
import numpy as np
import pytest

from ...metadata_edits import with_metadata_checksums_recomputed, without_metadata_checksums
from ...python_subprocess import run_command
from ...traced_memory import TracedPeak
from .checkpoints import copy, load_outcome, save, verify_fails

EDITS_AFTER = {
    "checksummed": lambda path: None,
    "recomputed": with_metadata_checksums_recomputed,
    "unchecksummed": without_metadata_checksums,
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save(tmp_path_factory.mktemp("saved") / "c")


def _edited_metadata(checkpoint, leaf: str, **changes) -> None:
    """Changes recorded fields of ``leaf``'s ``_METADATA`` entry."""
    file = checkpoint / "pytree" / "_METADATA"
    document = json.loads(file.read_text())
    (entry,) = [v for k, v in document["tree_metadata"].items() if f"'{leaf}'" in k]
    for field, value in changes.items():
        if field == "value_type":
            entry["value_metadata"]["value_type"] = value
        else:
            entry["value_metadata"]["checkpointables"][field] = value
    file.write_text(json.dumps(document))


@pytest.mark.parametrize("after", EDITS_AFTER)
@pytest.mark.parametrize(
    "content",
    [b"\xff" * 8, pickle.dumps({"item_handlers": {}}), b"[" * 100_000 + b"]" * 100_000],
    ids=["non-utf8", "pickle", "deep-json"],
)
@pytest.mark.parametrize(
    "relative",
    ["_CHECKPOINT_METADATA", "pytree/_METADATA", "pytree/_strings.json", "meta/data.json"],
)
def test_garbage_in_a_metadata_file_is_a_library_error(
    saved, tmp_path, relative, content, after
) -> None:
    checkpoint = copy(saved, tmp_path / "c")
    (checkpoint / relative).write_bytes(content)
    EDITS_AFTER[after](checkpoint)
    assert load_outcome(checkpoint) in ("IntegrityError", "MetadataError")
    assert verify_fails(checkpoint)


@pytest.mark.parametrize("after", EDITS_AFTER)
@pytest.mark.parametrize(
    "shape",
    [[10**12], [10**6, 10**6], [-5], ["x"], [2], [4], None, [3.5]],
    ids=["1e12", "1e6x1e6", "negative", "text", "shorter", "longer", "null", "float"],
)
def test_a_recorded_shape_that_lies_is_refused_before_any_allocation(
    saved, tmp_path, shape, after
) -> None:
    checkpoint = copy(saved, tmp_path / "c")
    _edited_metadata(checkpoint, "a", shape=shape, chunk_shape=shape)
    EDITS_AFTER[after](checkpoint)
    assert load_outcome(checkpoint) in ("IntegrityError", "MetadataError")
    assert verify_fails(checkpoint)


@pytest.mark.parametrize(
    ("leaf", "changes"),
    [
        ("a", {"dtype": "float32"}),  # Same size as the int32 saved: only the store can tell.
        ("n", {"scalar_type": "float"}),
        ("a", {"crc32": [1, 2]}),
    ],
)
def test_recorded_types_and_checksums_that_lie_are_caught(saved, tmp_path, leaf, changes) -> None:
    checkpoint = copy(saved, tmp_path / "c")
    _edited_metadata(checkpoint, leaf, **changes)
    assert load_outcome(checkpoint) == "IntegrityError"


@pytest.mark.parametrize("after", EDITS_AFTER)
def test_a_dtype_of_the_same_size_is_checked_against_the_array_store(saved, tmp_path, after):
    checkpoint = copy(saved, tmp_path / "c")
    _edited_metadata(checkpoint, "a", dtype="float32")  # Saved as int32.
    EDITS_AFTER[after](checkpoint)
    # Loads trust metadata whose recorded checksum matches (forged checksums are out of
    # scope, see docs/integrity.md); verify compares it with the array store anyway.
    # With its checksums there, _METADATA fails them; without, it contradicts the array's
    # zarr.json, which the load compares it with (docs/integrity.md: MetadataError).
    if after != "recomputed":
        expected = "MetadataError" if after == "unchecksummed" else "IntegrityError"
        assert load_outcome(checkpoint) == expected
    assert verify_fails(checkpoint)


def test_an_unknown_value_type_fails_the_load_and_verify(saved, tmp_path) -> None:
    checkpoint = copy(saved, tmp_path / "c")
    _edited_metadata(checkpoint, "n", value_type="mystery")
    with_metadata_checksums_recomputed(checkpoint)
    assert load_outcome(checkpoint) == "MissingHandlerError"
    assert verify_fails(checkpoint)


def test_a_lost_metadata_entry_is_caught(saved, tmp_path) -> None:
    for after in EDITS_AFTER:
        checkpoint = copy(saved, tmp_path / after)
        file = checkpoint / "pytree" / "_METADATA"
        document = json.loads(file.read_text())
        del document["tree_metadata"][next(k for k in document["tree_metadata"] if "'a'" in k)]
        file.write_text(json.dumps(document))
        EDITS_AFTER[after](checkpoint)
        if after == "checksummed":
            assert load_outcome(checkpoint) == "IntegrityError"
        # Without trustworthy checksums a load cannot tell (documented); verify compares the
        # metadata with the arrays the database holds.
        assert verify_fails(checkpoint), after


def test_a_deleted_checkpointable_fails_the_load_and_verify(saved, tmp_path) -> None:
    for after in EDITS_AFTER:
        checkpoint = copy(saved, tmp_path / after)
        shutil.rmtree(checkpoint / "pytree")
        EDITS_AFTER[after](checkpoint)
        assert load_outcome(checkpoint) == "IntegrityError", after
        with pytest.raises(cp.errors.IntegrityError, match="pytree"):
            cp.load_pytree(checkpoint)
        assert verify_fails(checkpoint), after


def test_verify_command_exit_status_names_the_problem(saved, tmp_path) -> None:
    checkpoint = copy(saved, tmp_path / "c")
    _edited_metadata(checkpoint, "a", shape=[21])
    result = run_command("verify", str(checkpoint))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "pytree/_METADATA" in result.stdout and "FAILED" in result.stdout


def test_a_1e12_element_array_claimed_by_the_array_store_is_refused(tmp_path) -> None:
    # An Orbax-style checkpoint (no recorded layout): the zarr.json claims the size.
    cp.save_pytree(tmp_path / "c", {"big": np.arange(100_000, dtype=np.float32)})
    without_metadata_checksums(tmp_path / "c")
    import tensorstore as ts
    from checkpointables_pytree import ocdbt, zarr3

    file = tmp_path / "c" / "pytree" / "_METADATA"
    document = json.loads(file.read_text())
    for entry in document["tree_metadata"].values():
        entry["value_metadata"].pop("checkpointables", None)
    document.pop("checkpointables")
    file.write_text(json.dumps(document))
    store = ts.KvStore.open(
        ocdbt.kvstore_spec(tmp_path / "c" / "pytree"), context=ocdbt.make_context()
    ).result()
    metadata = zarr3.metadata_dict((10**12,), np.float32, (10**12,))
    store.write("big/zarr.json", json.dumps(metadata).encode()).result()
    with pytest.raises(cp.errors.MetadataError, match="more than this machine's memory"):
        cp.load_pytree(tmp_path / "c")


def _tree_edited(checkpoint, edit) -> None:
    """Applies ``edit`` to ``_METADATA``'s ``tree_metadata``, then records the checksums
    again (as someone editing on purpose can)."""
    file = checkpoint / "pytree" / "_METADATA"
    document = json.loads(file.read_text())
    edit(document["tree_metadata"])
    file.write_text(json.dumps(document))
    with_metadata_checksums_recomputed(checkpoint)


def test_a_list_index_far_past_its_items_is_refused_before_padding(tmp_path) -> None:
    # A dict key "200000000" relabelled a list index: a list of 2e8 Nones (6 GiB) if padded.
    cp.save_pytree(tmp_path / "c", {"w": np.arange(8.0), "lst": {"200000000": 7}})

    def to_sequence(tree_metadata) -> None:
        (key,) = [k for k in tree_metadata if "lst" in k]
        tree_metadata[key]["key_metadata"][1]["key_type"] = 1

    _tree_edited(tmp_path / "c", to_sequence)
    for read in (cp.load_pytree, cp.pytree_metadata):
        with pytest.raises(cp.errors.MetadataError, match=r"1 items at indices up to 200000000"):
            read(tmp_path / "c")


def test_a_key_path_nested_past_the_limit_is_refused_at_once(tmp_path) -> None:
    # 50,000 levels in 1.4 MB of flat JSON: quadratic work, then a RecursionError, if built.
    cp.save_pytree(tmp_path / "c", {"w": np.arange(8.0), "k": 1})

    def deepen(tree_metadata) -> None:
        (key,) = [k for k in tree_metadata if "'k'" in k]
        entry = tree_metadata.pop(key)
        entry["key_metadata"] = [{"key": "k", "key_type": 2}] * 50_000
        tree_metadata[str(("k",) * 50_000)] = entry

    _tree_edited(tmp_path / "c", deepen)
    with pytest.raises(cp.errors.MetadataError, match="nested 50000 levels deep"):
        cp.pytree_metadata(tmp_path / "c")
    with pytest.raises(cp.errors.CheckpointError):
        cp.load_pytree(tmp_path / "c")


@pytest.mark.parametrize(
    ("relative", "error"),
    [
        ("_CHECKPOINT_METADATA", "MetadataError"),
        ("pytree/_METADATA", "MetadataError"),
        ("_CHECKSUMS", "IntegrityError"),
        ("pytree/_strings.json", "MetadataError"),
    ],
)
def test_a_metadata_file_of_many_gib_is_refused_before_it_is_read(
    saved, tmp_path, relative, error
) -> None:
    # Sparse: 3 GiB that occupy no disk. Read whole, it took 6.3 GiB and 17-38 s.
    checkpoint = copy(saved, tmp_path / "c")
    with open(checkpoint / relative, "r+b") as f:
        f.truncate(3 << 30)
    with TracedPeak() as traced:
        outcome = load_outcome(checkpoint)
    assert outcome == error and traced.peak < 64 << 20, (outcome, traced.peak)
    assert verify_fails(checkpoint)


def _subarray_dtype(tree_metadata) -> None:
    (key,) = [k for k in tree_metadata if "'a'" in k]
    tree_metadata[key]["value_metadata"]["checkpointables"]["dtype"] = "(100000,100000)f8"


def _huge_index(tree_metadata) -> None:
    (key,) = [k for k in tree_metadata if "'n'" in k]
    entry = dict(tree_metadata[key], key_metadata=[{"key": 10**18, "key_type": 1}])
    tree_metadata["(0,)"] = entry


def _datetime_scalar(tree_metadata) -> None:
    (key,) = [k for k in tree_metadata if "'n'" in k]
    tree_metadata[key]["value_metadata"]["checkpointables"]["scalar_type"] = "np.datetime64"


@pytest.mark.parametrize("edit", [_subarray_dtype, _huge_index, _datetime_scalar])
def test_recorded_types_numpy_or_jax_refuse_are_a_library_error_or_ignored(
    saved, tmp_path, edit
) -> None:
    # NumPy refuses the dtype (ValueError), JAX's key entry the index (TypeError), a
    # datetime is no scalar: either the load is exact (the stored data decides) or fails
    # with the library's error; so does reading the metadata.
    checkpoint = copy(saved, tmp_path / "c")
    _tree_edited(checkpoint, edit)
    assert load_outcome(checkpoint) in ("exact", "MetadataError")
    with contextlib.suppress(cp.errors.CheckpointError):
        cp.pytree_metadata(checkpoint)


def test_a_commit_time_past_64_bits_is_a_metadata_error(saved, tmp_path) -> None:
    # datetime refuses it: an OverflowError escaped pytree_metadata().commit_timestamp.
    checkpoint = copy(saved, tmp_path / "c")
    file = checkpoint / "_CHECKPOINT_METADATA"
    file.write_text(json.dumps(dict(json.loads(file.read_text()), commit_timestamp_nsecs=10**30)))
    with_metadata_checksums_recomputed(checkpoint)
    with pytest.raises(cp.errors.MetadataError, match="must be a non-negative 64-bit integer"):
        _ = cp.pytree_metadata(checkpoint).commit_timestamp
