"""Every single-bit flip of every byte of every metadata file of a small checkpoint.

Each flip must leave a checkpoint that either loads exactly what was saved
or raises a ``cp.errors.CheckpointError``; never other values, never another
exception. When the load fails, ``checkpointables verify`` must fail too
(checked for one flip in every 8 bytes, which keeps the test near 30 s).
"""

from __future__ import annotations

import collections
import os

import pytest

from .checkpoints import load_outcome, save, verify_fails

pytestmark = pytest.mark.slow

# Orbax's per-process array metadata: never read by a load (nor covered by checksums).
NOT_READ = ("pytree/array_metadatas/",)


def _files(checkpoint) -> list[str]:
    """Every file of the checkpoint a load may read, relative to it."""
    found = []
    for directory, _, names in os.walk(checkpoint):
        for name in names:
            relative = os.path.relpath(os.path.join(directory, name), checkpoint)
            if not relative.startswith(NOT_READ):
                found.append(relative)
    return sorted(found)


def _replace(path: str, data: bytes) -> None:
    # A new file, as damage found by a fresh process would be: nothing cached about the old.
    with open(path + ".flip", "wb") as f:
        f.write(data)
    os.replace(path + ".flip", path)


def test_every_bit_flip_in_metadata_loads_exactly_or_raises_a_library_error(tmp_path) -> None:
    checkpoint = save(tmp_path / "c")
    files = _files(checkpoint)
    assert {"_CHECKPOINT_METADATA", "_CHECKSUMS", "pytree/_METADATA", "meta/data.json"} <= set(
        files
    )
    outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
    for relative in files:
        path = os.path.join(checkpoint, relative)
        with open(path, "rb") as f:
            original = f.read()
        for position in range(len(original)):
            for bit in range(8):
                damaged = bytearray(original)
                damaged[position] ^= 1 << bit
                _replace(path, bytes(damaged))
                outcome = load_outcome(checkpoint)
                outcomes[(relative, outcome)] += 1
                if outcome != "exact" and position % 8 == 0 and bit == position // 8 % 8:
                    assert verify_fails(checkpoint), (relative, position, bit, outcome)
        _replace(path, original)
    # Every flip of a file that loads read is caught (the others are not read at all).
    caught_everywhere = {"_CHECKPOINT_METADATA", "_CHECKSUMS", "pytree/_METADATA", "meta/data.json"}
    for relative in caught_everywhere:
        assert outcomes[(relative, "exact")] == 0, (relative, outcomes)
    assert load_outcome(checkpoint) == "exact"
