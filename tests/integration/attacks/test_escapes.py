"""Checkpoints that point outside themselves: recorded names and symbolic links.

A load never opens a file outside the checkpoint directory, and no error
message quotes bytes of a file outside it.
"""

from __future__ import annotations

import json
import os

import checkpointables as cp
import numpy as np
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


@pytest.mark.parametrize("leading_out", ["absolute", "../x"])
def test_an_array_name_leading_out_of_a_layout_without_ocdbt_is_refused(
    tmp_path, leading_out
) -> None:
    """Orbax's layout of one directory per array: a recorded name that is a path outside."""
    from orbax.checkpoint import v1 as ocp

    options = ocp.options.ArrayOptions(
        saving=ocp.options.ArrayOptions.Saving(use_ocdbt=False, use_zarr3=True)
    )
    with ocp.Context(array_options=options):
        ocp.save(tmp_path / "victim", {"secret": np.full(3, 666)})
        ocp.save(tmp_path / "c", {"x": np.arange(3)})
    outside = os.path.join(tmp_path, "victim", "state", "secret")
    name = outside if leading_out == "absolute" else os.path.relpath(outside, tmp_path / "c/state")
    file = tmp_path / "c" / "state" / "_METADATA"  # Orbax's name for the pytree.
    document = json.loads(file.read_text())
    (entry,) = document["tree_metadata"].values()
    entry["key_metadata"] = [{"key": name, "key_type": 2}]
    document["tree_metadata"] = {f"({name!r},)": entry}
    file.write_text(json.dumps(document))
    with pytest.raises(cp.errors.OutsideCheckpointError, match="nothing was read"):
        cp.load_pytree(tmp_path / "c")  # Was {name: [666, 666, 666]}, another's data.
    assert verify_fails(tmp_path / "c")
