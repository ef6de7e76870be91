"""Metadata files cut short (a full disk, a crash of a copy, a partial download).

Every file a load reads, truncated at several lengths, with and without the
checksums recorded at commit: the load returns exactly what was saved or
raises a library error, and ``checkpointables verify`` fails whenever the
load does.
"""

from __future__ import annotations

import os

import pytest

from ...metadata_edits import without_metadata_checksums
from .checkpoints import copy, load_outcome, save, verify_fails

FILES = (
    "_CHECKPOINT_METADATA",
    "_CHECKSUMS",
    "pytree/_METADATA",
    "pytree/_sharding",
    "pytree/_strings.json",
    "pytree/manifest.ocdbt",
    "meta/data.json",
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save(tmp_path_factory.mktemp("saved") / "c")


@pytest.mark.parametrize("checksums", [True, False], ids=["checksummed", "unchecksummed"])
@pytest.mark.parametrize("relative", FILES)
def test_truncated_file_loads_exactly_or_raises(saved, tmp_path, relative, checksums) -> None:
    if relative == "_CHECKSUMS" and not checksums:
        pytest.skip("the file is the checksums")
    original = (saved / relative).read_bytes()
    for length in sorted({0, 1, len(original) // 3, len(original) // 2, len(original) - 1}):
        checkpoint = copy(saved, tmp_path / f"cut{length}")
        if not checksums:
            without_metadata_checksums(checkpoint)
        with open(checkpoint / relative, "r+b") as f:
            f.truncate(length)
        outcome = load_outcome(checkpoint)
        if outcome != "exact":
            assert verify_fails(checkpoint), (relative, length, outcome)
        # A load does not read _sharding; _CHECKSUMS may lose its final newline.
        unread = relative == "pytree/_sharding" or original[length:] == b"\n"
        if checksums and not unread:
            assert outcome != "exact", (relative, length)


def test_a_missing_metadata_file_is_an_integrity_error(saved, tmp_path) -> None:
    for relative in ("pytree/_METADATA", "pytree/_strings.json", "meta/data.json"):
        checkpoint = copy(saved, tmp_path / relative.replace("/", "-"))
        os.remove(checkpoint / relative)
        assert load_outcome(checkpoint) in ("IntegrityError", "MetadataError"), relative
        assert verify_fails(checkpoint), relative
