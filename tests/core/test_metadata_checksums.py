"""``cp.metadata_checksums``: the table written at commit, and reads checked against it."""

from __future__ import annotations

import json
import os

import checkpointables as cp
import pytest


@pytest.fixture
def saved(tmp_path):
    cp.save_checkpointables(tmp_path / "c", {"extra": {"k": 1}, "more": {"j": [1, 2]}})
    return tmp_path / "c"


def _table(checkpoint) -> dict:
    return json.loads((checkpoint / "_CHECKSUMS").read_text())


def test_the_table_covers_top_level_files_of_the_checkpoint_and_its_checkpointables(saved):
    (saved / "extra" / "sub").mkdir()
    (saved / "extra" / "sub" / "deep.json").write_text("{}")
    cp.metadata_checksums.record(saved)
    table = _table(saved)
    assert table["algorithm"] == "crc32" and table["format"] == 1
    assert set(table["files"]) == {
        "_CHECKPOINT_METADATA",
        "commit_success.txt",
        "orbax.checkpoint",
        "extra/data.json",
        "more/data.json",
    }
    assert cp.metadata_checksums.is_protected(saved)
    assert cp.metadata_checksums.verify(saved) == []


def test_files_above_the_limit_are_data_left_to_their_handlers(saved, monkeypatch):
    monkeypatch.setattr(cp.metadata_checksums, "MAX_FILE_BYTES", 10)
    cp.metadata_checksums.record(saved)
    assert set(_table(saved)["files"]) == {"extra/data.json", "orbax.checkpoint"}


def test_reads_are_checked(saved):
    file = saved / "more" / "data.json"
    assert cp.metadata_checksums.read_file(file) == b'{"j": [1, 2]}'
    assert cp.metadata_checksums.read_checked(file).checked
    file.write_text('{"j": [1, 3]}')
    with pytest.raises(cp.errors.IntegrityError, match="does not match its recorded checksum"):
        cp.metadata_checksums.read_file(file)
    os.remove(file)
    with pytest.raises(cp.errors.IntegrityError, match="is missing"):
        cp.metadata_checksums.read_file(file)
    (saved / "more" / "planted").write_text("{}")
    with pytest.raises(cp.errors.IntegrityError, match="not part of the checkpoint"):
        cp.metadata_checksums.read_file(saved / "more" / "planted")
    with pytest.raises(FileNotFoundError):  # Not recorded, not there: optional.
        cp.metadata_checksums.read_file(saved / "more" / "_sharding")
    problems = cp.metadata_checksums.verify(saved)
    assert len(problems) == 1 and "more/data.json is missing" in problems[0]


@pytest.mark.parametrize("position", [0, 20, -20, -3])
def test_a_damaged_table_trusts_nothing(saved, position):
    raw = bytearray((saved / "_CHECKSUMS").read_bytes())
    raw[position] ^= 0x04
    os.remove(saved / "_CHECKSUMS")  # A new file: nothing cached about the old one.
    (saved / "_CHECKSUMS").write_bytes(bytes(raw))
    with pytest.raises(cp.errors.IntegrityError, match="failed its own checksum"):
        cp.metadata_checksums.read_file(saved / "extra" / "data.json")
    assert "failed its own checksum" in cp.metadata_checksums.verify(saved)[0]


def test_without_a_table_reads_are_unchecked(saved):
    os.remove(saved / "_CHECKSUMS")
    assert not cp.metadata_checksums.is_protected(saved)
    checked = cp.metadata_checksums.read_checked(saved / "extra" / "data.json")
    assert checked.data == b'{"k": 1}' and not checked.checked


def test_one_operation_looks_the_table_up_once(saved):
    file = saved / "extra" / "data.json"
    with cp.metadata_checksums.scope():
        cp.metadata_checksums.read_file(saved / "_CHECKPOINT_METADATA")
        os.remove(saved / "_CHECKSUMS")  # Gone in the middle of the operation ...
        file.write_text('{"k": 2}')
        with pytest.raises(cp.errors.IntegrityError):  # ... the table read first still holds.
            cp.metadata_checksums.read_file(file)
    assert cp.metadata_checksums.read_file(file) == b'{"k": 2}'  # A new operation: no table.
