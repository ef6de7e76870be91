"""What a load without an abstract tree trusts ``_METADATA`` for, checked against what is stored.

Each test edits a type record of a checkpoint that has no trustworthy metadata
checksums (Orbax's kind, or ours after an edit with ``_CHECKSUMS`` recomputed).
A load then returns exactly what was saved or raises a library error naming
the leaf, and ``checkpointables verify`` fails whenever the load fails.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import checkpointables as cp
import jax
import numpy as np
import pytest
from checkpointables import _verification
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ...metadata_edits import with_metadata_checksums_recomputed, without_metadata_checksums

IMPLS = ["threefry2x32", "rbg", "unsafe_rbg"]
SCALAR_TYPES = ["int", "float", "bool", "complex", "np.int8", "np.uint8", "np.float16", "np.int64"]


def _edit(checkpoint: Path, leaf: str, **changes) -> None:
    """Sets (``None``: removes) fields of ``leaf``'s own record in ``_METADATA``."""
    file = checkpoint / "pytree" / "_METADATA"
    document = json.loads(file.read_text())
    own = document["tree_metadata"][f"('{leaf}',)"]["value_metadata"]["checkpointables"]
    for field, value in changes.items():
        if value is None:
            own.pop(field, None)
        else:
            own[field] = value
    file.write_text(json.dumps(document))


def _problems(checkpoint: Path) -> list[str]:
    return [f.problem for f in _verification.verify_checkpoint(checkpoint) if f.problem]


def _load(checkpoint: Path):
    """The loaded tree, or the library error it raised (anything else fails the test)."""
    try:
        return cp.load_pytree(checkpoint)
    except cp.errors.CheckpointError as e:
        return e


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "c"
    cp.save_pytree(
        path,
        {
            "step": 12345,
            "one": 1,
            "x": 2.5,
            "k": jax.random.key(0),
            "b": b"xy",
            "a": np.arange(3, dtype=np.int32),
        },
    )
    return path


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    leaf=st.sampled_from(["step", "one", "x"]),
    recorded=st.sampled_from(SCALAR_TYPES),
    recompute=st.booleans(),
)
def test_a_recorded_scalar_type_holds_the_stored_value_or_the_load_fails(
    saved, leaf, recorded, recompute
) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = Path(shutil.copytree(saved, Path(scratch) / "c"))
        _edit(checkpoint, leaf, scalar_type=recorded)
        (with_metadata_checksums_recomputed if recompute else without_metadata_checksums)(
            checkpoint
        )
        saved_value = {"step": 12345, "one": 1, "x": 2.5}[leaf]
        loaded = _load(checkpoint)
        if isinstance(loaded, cp.errors.CheckpointError):
            assert isinstance(loaded, cp.errors.MetadataError) and f"['{leaf}']" in str(loaded)
            assert any(f"['{leaf}']" in p for p in _problems(checkpoint))
        else:
            # What metadata alone decides (docs/integrity.md): 1 as True, 12345 as 12345.0.
            assert loaded[leaf] == saved_value
            assert not _problems(checkpoint)


def test_int_recorded_as_bool_is_refused(saved, tmp_path) -> None:
    checkpoint = shutil.copytree(saved, tmp_path / "c")
    _edit(checkpoint, "step", scalar_type="bool")
    without_metadata_checksums(checkpoint)
    with pytest.raises(cp.errors.MetadataError, match=r"\['step'\].*'bool'"):
        cp.load_pytree(checkpoint)
    assert _problems(checkpoint)


@pytest.mark.parametrize("after", [without_metadata_checksums, with_metadata_checksums_recomputed])
@pytest.mark.parametrize("impl", IMPLS)
def test_a_recorded_key_implementation_must_fit_the_key_data(saved, tmp_path, impl, after):
    checkpoint = shutil.copytree(saved, tmp_path / "c")
    _edit(checkpoint, "k", random_key_impl=impl)  # Saved: threefry2x32, (2,) uint32 data.
    after(checkpoint)
    loaded = _load(checkpoint)
    if impl == "threefry2x32":
        assert jax.random.key_impl(loaded["k"]) == impl and not _problems(checkpoint)
        return
    assert isinstance(loaded, cp.errors.MetadataError) and "['k']" in str(loaded)
    assert any("['k']" in p for p in _problems(checkpoint))


def test_a_key_whose_implementation_was_lost_fails_verify(saved, tmp_path) -> None:
    checkpoint = shutil.copytree(saved, tmp_path / "c")
    _edit(checkpoint, "k", random_key_impl=None, value_type=None)
    without_metadata_checksums(checkpoint)
    # Loads as its key data (metadata alone decides); array_metadatas/ still says keys.
    assert not jax.dtypes.issubdtype(cp.load_pytree(checkpoint)["k"].dtype, jax.dtypes.prng_key)
    assert any("['k']" in p and "threefry2x32" in p for p in _problems(checkpoint))


@pytest.mark.parametrize("leaf", ["a", "step"])
def test_bytes_recorded_for_an_array_that_is_not_uint8_is_refused(saved, tmp_path, leaf) -> None:
    checkpoint = shutil.copytree(saved, tmp_path / "c")
    _edit(checkpoint, leaf, value_type="bytes")
    without_metadata_checksums(checkpoint)
    with pytest.raises(cp.errors.MetadataError, match=rf"\['{leaf}'\].*bytes"):
        cp.load_pytree(checkpoint)
    assert any(f"['{leaf}']" in p for p in _problems(checkpoint))


def test_a_deleted_checksums_file_is_reported(saved, tmp_path) -> None:
    checkpoint = shutil.copytree(saved, tmp_path / "c")
    (checkpoint / cp.metadata_checksums.CHECKSUMS_FILE).unlink()
    with pytest.raises(cp.errors.IntegrityError, match="_CHECKSUMS is missing"):
        cp.load_pytree(checkpoint)
    (problem,) = _problems(checkpoint)
    assert "_CHECKSUMS is missing" in problem
