"""A named pipe (or a link to one, or a directory) where a checkpoint has a file.

Opening a pipe for reading waits for a writer that never comes: a load,
a metadata read or ``checkpointables verify`` must instead refuse it at
once with the library's error naming it, whichever file it replaces and
whether or not the checkpoint recorded its metadata checksums.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import checkpointables as cp
import numpy as np
import pytest
from checkpointables import _verification

from ...metadata_edits import without_metadata_checksums
from ...special_files import KINDS, bounded, copy, replace_with
from .checkpoints import save

# Every file a load or verify reads ("pytree/d/*": the database's data file). The JSON
# checkpointable of the attacked checkpoint is "meta".
READ_FILES = (
    "_CHECKPOINT_METADATA",
    "_CHECKSUMS",
    "meta/data.json",
    "pytree/_METADATA",
    "pytree/_sharding",
    "pytree/_strings.json",
    "pytree/manifest.ocdbt",
    "pytree/d/*",
)
# Files no load reads, but part of the checkpoint: refused all the same.
OTHER_FILES = ("commit_success.txt", "orbax.checkpoint", "pytree/array_metadatas/process_0")
REFUSED = (cp.errors.IntegrityError, cp.errors.NotACheckpointError)
CALLS = {
    "load_pytree": cp.load_pytree,
    "load_checkpointables": cp.load_checkpointables,
    "checkpointables_metadata": cp.checkpointables_metadata,
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save(tmp_path_factory.mktemp("saved") / "c")


def _attacked(saved, tmp_path, pattern: str, kind: str, checksums: bool):
    """A copy of ``saved`` whose file ``pattern`` is a ``kind``; returns it and that path."""
    checkpoint = copy(saved, tmp_path / "c")
    if not checksums:
        without_metadata_checksums(checkpoint)
    (file,) = glob.glob(os.path.join(checkpoint, pattern))
    replace_with(file, kind)
    return checkpoint, file


def _problems(checkpoint) -> list[str]:
    return [f.problem for f in _verification.verify_checkpoint(checkpoint) if f.problem]


@pytest.mark.parametrize("checksums", [True, False], ids=["checksums", "no-checksums"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pattern", READ_FILES + OTHER_FILES)
def test_a_pipe_or_directory_for_a_file_is_refused_at_once(
    saved, tmp_path, pattern, kind, checksums
) -> None:
    if pattern == "_CHECKSUMS" and not checksums:
        pytest.skip("no _CHECKSUMS to replace")
    if kind == "directory" and pattern in OTHER_FILES:
        pytest.skip("a directory there is a checkpointable's directory, not a file")
    checkpoint, file = _attacked(saved, tmp_path, pattern, kind, checksums)
    named = os.path.basename(file)  # A directory for data.json: "meta holds no data.json".
    for name, call in CALLS.items():
        took, outcome = bounded(lambda call=call: call(checkpoint), checkpoint)
        assert took < 10, f"{name} took {took:.1f} s"
        if kind == "directory":  # Refused by what reads it (a load may not need the file).
            assert isinstance(outcome, REFUSED) or not isinstance(outcome, BaseException), outcome
        else:  # Pipes are refused wherever they are, before anything is read.
            assert isinstance(outcome, REFUSED), f"{name}: {outcome!r}"
            # The link, or the pipe it points to (named after it), is named.
            assert named in str(outcome), f"{name}: {outcome}"
            assert "is a named pipe (FIFO)" in str(outcome), f"{name}: {outcome}"
    took, problems = bounded(lambda: _problems(checkpoint), checkpoint)
    assert not isinstance(problems, BaseException), problems
    assert problems
    assert kind == "directory" or any(named in p for p in problems), problems


def test_a_pipe_in_a_checkpoint_saved_without_ocdbt_is_refused(tmp_path) -> None:
    """Orbax's layout of one directory per array: a pipe for an array's ``zarr.json``."""
    from orbax.checkpoint import v1 as ocp

    options = ocp.options.ArrayOptions(
        saving=ocp.options.ArrayOptions.Saving(use_ocdbt=False, use_zarr3=True)
    )
    with ocp.Context(array_options=options):
        ocp.save(tmp_path / "c", {"x": np.arange(4.0)})
    (file,) = glob.glob(os.path.join(tmp_path / "c", "**", "x", "zarr.json"), recursive=True)
    replace_with(file, "fifo")
    _, outcome = bounded(lambda: cp.load_pytree(tmp_path / "c"), tmp_path)
    assert isinstance(outcome, cp.errors.IntegrityError), outcome
    assert file in str(outcome)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``checkpointables *args`` in a new process, which must end within a minute."""
    return subprocess.run(
        [sys.executable, "-m", "checkpointables", "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("pattern", "checksums"), [("meta/data.json", True), ("pytree/_METADATA", False)]
)
def test_verify_and_inspect_refuse_a_pipe_at_once(saved, tmp_path, pattern, checksums) -> None:
    checkpoint, file = _attacked(saved, tmp_path, pattern, "fifo", checksums)
    verify = _cli("verify", str(checkpoint))
    assert verify.returncode == 1, verify.stderr
    assert f"{file} is a named pipe (FIFO)" in verify.stdout
    inspect = _cli("inspect", str(checkpoint))
    assert inspect.returncode == 2, inspect.stderr
    assert f"{file} is a named pipe (FIFO)" in inspect.stderr
