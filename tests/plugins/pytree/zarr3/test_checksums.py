"""Array data is checked against zarr3's own CRC-32C, the checksum every zarr3 reader checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import checkpointables as cp
import crc32c
import jax
import numpy as np
import pytest

from ..damage import flip

# Written by the code before this library checked zarr3's CRC-32C itself: its _METADATA
# records checksums of its own ("crc32" for small arrays, "sums_crc32" for large ones).
BEFORE = Path(__file__).parents[1] / "fixtures" / "before-standard-crc32c"


def _verify(checkpoint) -> list[str]:
    return cp._asyncio.run_sync(cp.handlers.get("pytree")().verify(checkpoint / "pytree"))


def _expected_before() -> dict:
    return {
        "small": np.arange(12, dtype=np.float32).reshape(3, 4),
        "mid": np.arange(20_000, dtype=np.int32),
        "large": np.arange(80_000, dtype=np.float32) / 7,
        "sharded": np.arange(64 * 512, dtype=np.float32).reshape(64, 512),
        "step": 7,
        "lr": 0.5,
        "flag": True,
        "f32": np.float32(1.5),
        "name": "run-1",
        "blob": b"\x00\x01abc",
    }


def test_a_checkpoint_written_before_loads_and_verifies(tmp_path) -> None:
    recorded = json.loads((BEFORE / "pytree" / "_METADATA").read_text())
    fields = {
        k
        for v in recorded["tree_metadata"].values()
        for k in v["value_metadata"].get("checkpointables", {})
    }
    assert {"crc32", "sums_crc32"} <= fields  # What the fixture is for.
    copy = tmp_path / "before"
    shutil.copytree(BEFORE, copy)
    loaded = cp.load_pytree(copy)
    for key, value in _expected_before().items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(np.asarray(loaded[key]), value)
        else:
            assert loaded[key] == value and type(loaded[key]) is type(value), key
    assert jax.random.key_impl(loaded["key"]) == "threefry2x32"
    np.testing.assert_array_equal(
        jax.random.key_data(loaded["key"]), jax.random.key_data(jax.random.key(3))
    )
    assert loaded["empty"] == {} and loaded["none"] is None and loaded["pair"] == (1, 2)
    assert _verify(copy) == []


@pytest.mark.parametrize("leaf", ["mid", "large", "sharded"])
def test_damage_in_a_checkpoint_written_before_is_caught_by_the_crc32c(tmp_path, leaf) -> None:
    copy = tmp_path / "before"
    shutil.copytree(BEFORE, copy)
    value = _expected_before()[leaf]
    probe = value.reshape(-1)[-8:].tobytes() if leaf != "sharded" else value[0, :8].tobytes()
    (data_file,) = (copy / "pytree" / "d").iterdir()
    at = data_file.read_bytes().find(probe)
    assert at >= 0
    flip(data_file, at + 3)
    with pytest.raises(cp.errors.IntegrityError, match=leaf):
        cp.load_pytree(copy)
    (problem,) = _verify(copy)
    assert f"['{leaf}']" in problem


@pytest.mark.parametrize("size", [1000, 20_000, 300_000])
def test_each_shard_ends_with_the_crc32c_of_its_data(tmp_path, size) -> None:
    # The standard CRC-32C (Castagnoli) of the chunk's bytes, as zarr3's crc32c codec writes it.
    data = np.random.default_rng(size).standard_normal(size).astype(np.float32)
    cp.save_pytree(tmp_path / "c", {"w": data})
    raw = b"".join(p.read_bytes() for p in (tmp_path / "c" / "pytree" / "d").iterdir())
    at = raw.find(data.tobytes())
    assert at >= 0
    stored = raw[at + data.nbytes : at + data.nbytes + 4]
    assert int.from_bytes(stored, "little") == crc32c.crc32c(data.tobytes())
    assert crc32c.crc32c(b"123456789") == 0xE3069283  # The CRC-32C check value.


@pytest.mark.parametrize("size", [1000, 300_000])
def test_checking_can_be_turned_off_for_arrays_read_here(tmp_path, size) -> None:
    data = np.arange(size, dtype=np.float32)
    cp.save_pytree(tmp_path / "c", {"w": data})
    for data_file in (tmp_path / "c" / "pytree" / "d").iterdir():
        at = data_file.read_bytes().find(data.tobytes())
        if at >= 0:
            flip(data_file, at + data.nbytes)  # The CRC-32C itself: the data is intact.
    with pytest.raises(cp.errors.IntegrityError, match="CRC-32C"):
        cp.load_pytree(tmp_path / "c")
    (problem,) = _verify(tmp_path / "c")  # What loads check, verify checks.
    assert "['w']" in problem
    options = cp.options.ArrayOptions(verify_checksums=False)
    with cp.Context(array_options=options):
        np.testing.assert_array_equal(cp.load_pytree(tmp_path / "c")["w"], data)
