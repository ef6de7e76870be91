"""The checksums recorded per chunk: their definition, streaming, and what they catch."""

from __future__ import annotations

import json
import zlib

import checkpointables as cp
import numpy as np
import pytest
from checkpointables_pytree import _checksums, _database

from ...metadata_edits import without_metadata_checksums

_RNG = np.random.default_rng(11)
ROW_BYTES = _checksums.ROW_BYTES


def _reference_sums_crc32(data: bytes) -> int:
    """The documented definition, written as plainly as possible."""
    padded = data + bytes(-len(data) % ROW_BYTES)  # No data: no rows.
    words = [int.from_bytes(padded[i : i + 8], "little") for i in range(0, len(padded), 8)]
    rows = [words[i : i + 1024] for i in range(0, len(words), 1024)]
    row_sums = [sum(row) % 2**64 for row in rows]
    column_sums = [sum(row[c] for row in rows) % 2**64 for c in range(1024)]
    encoded = b"".join(s.to_bytes(8, "little") for s in row_sums + column_sums)
    return zlib.crc32(encoded)


def _sums(data: bytes | bytearray) -> int:
    return _checksums.checksum(_checksums.SUMS_CRC32, memoryview(data))


@pytest.mark.parametrize(
    "size", [0, 1, 7, 8, 9, ROW_BYTES - 1, ROW_BYTES, ROW_BYTES + 3, 3 * ROW_BYTES + 5]
)
def test_sums_match_the_documented_definition(size) -> None:
    data = _RNG.integers(0, 256, size, dtype=np.uint8).tobytes()
    assert _sums(data) == _reference_sums_crc32(data)


def test_sums_of_many_steps_match_the_definition() -> None:
    # More rows than one step of the implementation, and a partial last row.
    data = _RNG.integers(
        0, 256, (_checksums.ROWS_PER_STEP + 3) * ROW_BYTES + 11, np.uint8
    ).tobytes()
    assert _sums(data) == _reference_sums_crc32(data)


@pytest.mark.parametrize("kind", _checksums.KINDS)
def test_pieces_of_any_size_give_the_same_checksum(kind) -> None:
    data = _RNG.integers(0, 256, 5 * ROW_BYTES + 123, dtype=np.uint8).tobytes()
    whole = _checksums.checksum(kind, memoryview(data))
    for _ in range(5):
        cuts = sorted(_RNG.integers(0, len(data), 6).tolist())
        running = _checksums.running(kind)
        for start, stop in zip([0, *cuts], [*cuts, len(data)], strict=True):
            running.update(memoryview(data)[start:stop])
        assert running.digest() == whole


def test_arrays_are_checksummed_as_their_bytes() -> None:
    array = _RNG.standard_normal((37, 300)).astype(np.float32)
    for kind in _checksums.KINDS:
        assert _checksums.checksum(kind, array) == _checksums.checksum(
            kind, memoryview(array.tobytes())
        )
    assert _checksums.checksum(_checksums.CRC32, array) == zlib.crc32(array.tobytes())


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="Unknown checksum kind 'md5'"):
        _checksums.running("md5")


def _damaged(data: bytes, changes: dict[int, int]) -> bytearray:
    """``data`` with the 8-byte words at the given indices XORed with the given masks."""
    out = bytearray(data)
    for word, mask in changes.items():
        value = int.from_bytes(out[8 * word : 8 * word + 8], "little") ^ mask
        out[8 * word : 8 * word + 8] = value.to_bytes(8, "little")
    return out


def test_every_single_bit_flip_is_caught() -> None:
    data = _RNG.integers(0, 256, 2 * ROW_BYTES + 40, dtype=np.uint8).tobytes()
    original = _sums(data)
    for position in [0, 1, 8, ROW_BYTES - 1, ROW_BYTES, len(data) // 2, len(data) - 1]:
        for bit in range(8):
            damaged = bytearray(data)
            damaged[position] ^= 1 << bit
            assert _sums(damaged) != original, (position, bit)


def test_cancelling_flips_in_one_row_or_one_column_are_caught() -> None:
    # The top bit flipped one way in one word and the other way in another leaves a
    # plain sum unchanged; the other direction's sums catch it.
    zeros_and_top = np.zeros(4 * 1024, dtype="<u8")
    zeros_and_top[1] = 1 << 63  # Row 0, column 1 has the top bit set.
    zeros_and_top[2 * 1024 + 5] = 1 << 63  # Row 2, column 5.
    data = zeros_and_top.tobytes()
    original = _sums(data)
    top = 1 << 63
    same_row = _damaged(data, {1: top, 7: top})  # Row 0: one top bit cleared, one set.
    same_column = _damaged(data, {5: top, 2 * 1024 + 5: top})  # Column 5, rows 0 and 2.
    two_sets_one_row = _damaged(data, {3: top, 4: top})  # Sum of the row unchanged mod 2**64.
    for damaged in (same_row, same_column, two_sets_one_row):
        assert _sums(damaged) != original


def test_damage_to_up_to_three_words_is_always_caught() -> None:
    data = _RNG.integers(0, 256, 3 * ROW_BYTES, dtype=np.uint8).tobytes()
    original = _sums(data)
    words = len(data) // 8
    for _ in range(300):
        count = int(_RNG.integers(1, 4))
        chosen = _RNG.choice(words, size=count, replace=False).tolist()
        masks = _RNG.integers(1, 2**63, size=count, dtype=np.uint64).tolist()
        assert _sums(_damaged(data, dict(zip(chosen, masks, strict=True)))) != original


def test_swapped_rows_are_caught() -> None:
    data = bytearray(_RNG.integers(0, 256, 3 * ROW_BYTES, dtype=np.uint8).tobytes())
    original = _sums(data)
    first, last = data[:ROW_BYTES], data[-ROW_BYTES:]
    data[:ROW_BYTES], data[-ROW_BYTES:] = last, first
    assert _sums(data) != original


def test_large_arrays_record_sums_small_ones_zlib_crc32(tmp_path) -> None:
    tree = {
        "big": np.arange(200_000, dtype=np.float32),  # 800 KB: written by the zarr3 driver.
        # 80 KB: written by the driver too, read back in the small arrays' batch.
        "mid": np.arange(20_000, dtype=np.float32),
        "small": np.arange(10, dtype=np.float32),
    }
    assert _database.DIRECT_WRITE_BYTES < tree["mid"].nbytes <= _database.SMALL_ARRAY_BYTES
    cp.save_pytree(tmp_path / "c", tree)
    metadata = json.loads((tmp_path / "c" / "pytree" / "_METADATA").read_text())
    recorded = {
        key: value["value_metadata"]["checkpointables"]
        for key, value in metadata["tree_metadata"].items()
    }
    big = next(v for k, v in recorded.items() if "big" in k)
    small = next(v for k, v in recorded.items() if "small" in k)
    mid = next(v for k, v in recorded.items() if "mid" in k)
    assert big["sums_crc32"] == [_sums(tree["big"].tobytes())]
    assert mid["sums_crc32"] == [_sums(tree["mid"].tobytes())]
    assert "crc32" not in big and "crc32" not in mid
    assert small["crc32"] == [zlib.crc32(tree["small"].tobytes())]
    loaded = cp.load_pytree(tmp_path / "c")
    for key, value in tree.items():
        np.testing.assert_array_equal(loaded[key], value)


@pytest.mark.parametrize("correct", [True, False])
def test_a_large_array_recorded_with_a_zlib_crc32_is_checked_with_it(tmp_path, correct) -> None:
    # Checkpoints written before the sums recorded zlib CRC-32s for every array.
    big = np.arange(200_000, dtype=np.float32)
    path = tmp_path / "c"
    cp.save_pytree(path, {"big": big})
    metadata_file = path / "pytree" / "_METADATA"
    metadata = json.loads(metadata_file.read_text())
    (entry,) = metadata["tree_metadata"].values()
    recorded = entry["value_metadata"]["checkpointables"]
    del recorded["sums_crc32"]
    recorded["crc32"] = [zlib.crc32(big.tobytes()) ^ (0 if correct else 1)]
    metadata_file.write_text(json.dumps(metadata))
    without_metadata_checksums(path)  # Such checkpoints had none.
    if correct:
        np.testing.assert_array_equal(cp.load_pytree(path)["big"], big)
    else:
        with pytest.raises(cp.errors.IntegrityError, match="big"):
            cp.load_pytree(path)
