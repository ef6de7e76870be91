"""Checkpoints that point outside themselves: recorded names and symbolic links.

A load never opens a file outside the checkpoint directory, and no error
message quotes bytes of a file outside it.
"""

from __future__ import annotations

import json
import os

import checkpointables as cp
import pytest

from ...metadata_edits import with_metadata_checksums_recomputed, without_metadata_checksums
from .checkpoints import copy, is_exactly_saved, load_outcome, save, verify_fails

SECRET = b"TOP-SECRET-BYTES-OUTSIDE-THE-CHECKPOINT"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save(tmp_path_factory.mktemp("saved") / "c")


def _recorded_as(checkpoint, name: str) -> None:
    """Records the pytree under another name in ``_CHECKPOINT_METADATA``."""
    file = checkpoint / "_CHECKPOINT_METADATA"
    document = json.loads(file.read_text())
    handlers = document["item_handlers"]
    handlers[name] = handlers.pop("pytree")
    file.write_text(json.dumps(document))


@pytest.mark.parametrize("recompute", [True, False], ids=["recomputed", "unchecksummed"])
@pytest.mark.parametrize("name", ["../victim/pytree", "/abs/pytree", "a/b", "..", "", "x\\\\y"])
def test_a_recorded_name_that_is_not_a_plain_name_is_refused(
    saved, tmp_path, name, recompute
) -> None:
    victim = copy(saved, tmp_path / "victim")
    checkpoint = copy(saved, tmp_path / "c")
    _recorded_as(checkpoint, name.replace("/abs", str(victim)))
    (with_metadata_checksums_recomputed if recompute else without_metadata_checksums)(checkpoint)
    for call in (cp.load_checkpointables, cp.checkpointables_metadata, cp.load_pytree):
        with pytest.raises(cp.errors.OutsideCheckpointError, match="not a plain"):
            call(checkpoint)
    assert verify_fails(checkpoint)


@pytest.mark.parametrize("link", ["pytree", "pytree/d", "meta/data.json", "_CHECKPOINT_METADATA"])
def test_a_symbolic_link_out_of_the_checkpoint_is_refused(saved, tmp_path, link) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    checkpoint = copy(saved, tmp_path / "c")
    target = elsewhere / "target"
    os.rename(checkpoint / link, target)
    os.symlink(target, checkpoint / link)
    with pytest.raises(cp.errors.OutsideCheckpointError, match="symbolic link"):
        cp.load_checkpointables(checkpoint)
    assert verify_fails(checkpoint)


def test_no_error_quotes_bytes_of_a_file_outside(saved, tmp_path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET * 20)
    checkpoint = copy(saved, tmp_path / "c")
    for data_file in (checkpoint / "pytree" / "d").iterdir():
        data_file.unlink()
        data_file.symlink_to(secret)
    without_metadata_checksums(checkpoint)
    for call in (cp.load_checkpointables, cp.load_pytree, cp.pytree_metadata):
        with pytest.raises(cp.errors.CheckpointError) as info:
            call(checkpoint)
        assert SECRET[:8].decode() not in str(info.value)


def test_a_symbolic_link_inside_the_checkpoint_is_followed(saved, tmp_path) -> None:
    checkpoint = copy(saved, tmp_path / "c")
    os.rename(checkpoint / "meta" / "data.json", checkpoint / "meta" / "real.json")
    os.symlink("real.json", checkpoint / "meta" / "data.json")
    without_metadata_checksums(checkpoint)  # The table recorded data.json as a file.
    assert is_exactly_saved(cp.load_checkpointables(checkpoint))


def test_a_checkpoint_reached_through_a_link_loads(saved, tmp_path) -> None:
    os.symlink(saved, tmp_path / "link")
    assert load_outcome(tmp_path / "link") == "exact"
