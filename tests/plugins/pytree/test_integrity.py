"""Damaged checkpoints: checksums, malformed metadata, and the verify/inspect commands."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import checkpointables as cp
import jax.numpy as jnp
import numpy as np
import pytest
from checkpointables import _verification

from ...metadata_edits import without_metadata_checksums
from .damage import copies_with_a_flipped_bit, flip

_RNG = np.random.default_rng(0)
SMALL = _RNG.standard_normal(300)  # Batched path (encoded here).
# Written through the zarr3 driver, read back as a plain shard.
MID = _RNG.standard_normal(12_000)
BIG = _RNG.standard_normal(300_000)  # Not batched: written through the zarr3 driver.
TREE = {
    "small": SMALL,
    "mid": MID,
    "big": BIG,
    "jax": jnp.arange(50, dtype=jnp.int32),
    "n": 7,
    "name": "run",
}


@pytest.fixture
def saved(tmp_path):
    cp.save_pytree(tmp_path / "orig", TREE)
    return tmp_path / "orig"


def _flip_inside(directory, needle: bytes) -> None:
    """Flips a bit in the middle of the first file under ``directory/d`` holding ``needle``."""
    for path in sorted((directory / "pytree" / "d").iterdir()):
        position = path.read_bytes().find(needle)
        if position >= 0:
            flip(path, position + len(needle) // 2)
            return
    raise AssertionError("the array's bytes were not found in any data file")


def _copy(saved, tmp_path, name: str):
    target = tmp_path / name
    shutil.copytree(saved, target)
    return target


def _matches(loaded) -> bool:
    return all(
        np.array_equal(np.asarray(loaded[k]), np.asarray(v)) for k, v in TREE.items() if k != "name"
    )


def test_a_flipped_bit_anywhere_in_the_database_never_returns_wrong_numbers(
    saved, tmp_path
) -> None:
    for copy in copies_with_a_flipped_bit(saved, tmp_path, (1 / 5, 1 / 2, 4 / 5)):
        try:
            loaded = cp.load_pytree(copy)
        except cp.errors.IntegrityError:
            continue
        # Some bytes are unused padding: then the numbers must be exactly right.
        assert _matches(loaded), copy


@pytest.mark.parametrize(("leaf", "needle"), [("small", SMALL), ("mid", MID), ("big", BIG)])
def test_damaged_array_data_names_the_leaf(saved, tmp_path, leaf, needle) -> None:
    copy = _copy(saved, tmp_path, "c")
    _flip_inside(copy, needle.tobytes()[800:1600])
    with pytest.raises(cp.errors.IntegrityError, match=rf"\['{leaf}'\]"):
        cp.load_pytree(copy)
    # Other leaves still load.
    assert cp.load_pytree(copy, {"n": 0, "name": ""}, partial_load=True) == {"n": 7, "name": "run"}


@pytest.mark.parametrize("fast_path", [False, True])
def test_damaged_array_data_names_the_checkpoint_once(saved, tmp_path, fast_path) -> None:
    # With many steps open, the error must say which one is damaged.
    step_7, step_8 = _copy(saved, tmp_path, "step_7"), _copy(saved, tmp_path, "step_8")
    _flip_inside(step_8, MID.tobytes()[800:1600])
    cp.load_pytree(step_7)
    with (
        cp.Context(array_options=cp.options.ArrayOptions(ocdbt_fast_path=fast_path)),
        pytest.raises(cp.errors.IntegrityError) as raised,
    ):
        cp.load_pytree(step_8)
    message = str(raised.value)
    assert message.startswith(f"{step_8 / 'pytree'}: ['mid'] failed its integrity check: ")
    assert message.count(str(step_8)) == 1


def test_checks_can_be_turned_off_for_speed(saved, tmp_path) -> None:
    copy = _copy(saved, tmp_path, "c")
    _flip_inside(copy, SMALL.tobytes()[800:1600])
    with cp.Context(array_options=cp.options.ArrayOptions(verify_checksums=False)):
        loaded = cp.load_pytree(copy)
    assert not np.array_equal(loaded["small"], SMALL)  # Damage goes unnoticed: hence the default.
    np.testing.assert_array_equal(loaded["big"], BIG)


def test_missing_data_files_are_integrity_errors(saved, tmp_path) -> None:
    copy = _copy(saved, tmp_path, "c")
    shutil.rmtree(copy / "pytree" / "d")
    with pytest.raises(cp.errors.IntegrityError):
        cp.load_pytree(copy)


def test_edited_strings_file_fails_its_checksum(saved, tmp_path) -> None:
    copy = _copy(saved, tmp_path, "c")
    (copy / "pytree" / "_strings.json").write_text(json.dumps({"name": "RUN"}))
    with pytest.raises(cp.errors.IntegrityError, match="_strings.json"):
        cp.load_pytree(copy)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "'tree_metadata' object"),
        (
            '{"tree_metadata": {"x": {"key_metadata": [{"key": "a", "key_type": 7}], '
            '"value_metadata": {}}}}',
            "malformed key",
        ),
        (
            '{"tree_metadata": {"x": {"key_metadata": [], '
            '"value_metadata": {"skip_deserialize": false}}}}',
            "no 'value_type'",
        ),
    ],
)
def test_malformed_metadata_names_the_file(saved, tmp_path, text, problem) -> None:
    copy = _copy(saved, tmp_path, "c")
    (copy / "pytree" / "_METADATA").write_text(text)
    without_metadata_checksums(copy)  # Else the recorded checksum catches the edit first.
    for call in (cp.load_pytree, cp.pytree_metadata):
        with pytest.raises(cp.errors.MetadataError, match=problem) as info:
            call(copy)
        assert str(copy / "pytree" / "_METADATA") in str(info.value)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "checkpointables", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_verify_command(saved, tmp_path) -> None:
    copy = _copy(saved, tmp_path, "c")
    _flip_inside(copy, SMALL.tobytes()[800:1600])
    _flip_inside(copy, BIG.tobytes()[800:1600])
    intact, damaged = _cli("verify", str(saved)), _cli("verify", str(copy))
    assert intact.returncode == 0, intact.stdout + intact.stderr
    assert "pytree: ok" in intact.stdout
    assert damaged.returncode == 1, damaged.stdout + damaged.stderr
    failures = [line for line in damaged.stdout.splitlines() if "FAILED" in line]
    assert len(failures) == 2, damaged.stdout
    assert any("['small']" in f for f in failures) and any("['big']" in f for f in failures)
    assert all(f.count("['small']") + f.count("['big']") == 1 for f in failures), failures


def test_inspect_command(saved) -> None:
    result = _cli("inspect", str(saved))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "['big']: NumpyMetadata shape=(300000,) dtype=float64  (2,400,000 B)" in out
    assert "['jax']: ArrayMetadata shape=(50,) dtype=int32" in out
    assert "['n']: int" in out and "['name']: str" in out
    assert f"total array bytes: {BIG.nbytes + MID.nbytes + SMALL.nbytes + 200:,}" in out


def test_verify_api_lists_every_problem(saved, tmp_path) -> None:
    handler = cp.handlers.get("pytree")()
    assert cp._asyncio.run_sync(handler.verify(saved / "pytree")) == []
    copy = _copy(saved, tmp_path, "c")
    os.remove(copy / "pytree" / "_strings.json")
    problems = cp._asyncio.run_sync(handler.verify(copy / "pytree"))
    assert len(problems) == 1 and "_strings.json" in problems[0]


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast path", "TensorStore writes"])
def test_int4_arrays_verify_clean_whoever_wrote_their_zarr_json(tmp_path, fast_path) -> None:
    # TensorStore writes fill_value 0 for int4 (an integer type, of numpy kind "V"); ours
    # once wrote 0.0, and verify compared the bytes: a false "damaged" for TensorStore's.
    tree = {"q": jnp.asarray(np.arange(256).reshape(16, 16) % 8, jnp.int4)}
    options = cp.options.ArrayOptions(ocdbt_fast_path=fast_path)
    with cp.Context(array_options=options):
        cp.save_pytree(tmp_path / "c", tree)
    findings = _verification.verify_checkpoint(tmp_path / "c")
    assert [f.problem for f in findings if f.problem] == []
