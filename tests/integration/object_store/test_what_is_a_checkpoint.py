"""``cp.is_checkpoint`` and the loads agree on what a finished checkpoint is, on a local
disk and on an object store: a path a load refuses as no checkpoint
(``NotACheckpointError``) is never one ``is_checkpoint`` accepts, and a path it does not
accept never loads.

Each case copies some of the files of a real checkpoint (a marker alone, the marker
without its metadata, ...) to a new path. A load may find such a path damaged
(``IntegrityError``: the checksums name a file that is missing) rather than no checkpoint.
"""

from __future__ import annotations

import checkpointables as cp
import numpy as np
import pytest

_MARKER = "commit_success.txt"
_META = "_CHECKPOINT_METADATA"
_CASES = {
    "the commit marker alone": {_MARKER},
    "the marker and the checksums": {_MARKER, "_CHECKSUMS"},
    "the marker and orbax.checkpoint": {_MARKER, "orbax.checkpoint"},
    "everything but the metadata": {_MARKER, "_CHECKSUMS", "orbax.checkpoint", "pytree"},
    "the metadata alone": {_META},
    "the metadata files, no arrays": {_MARKER, _META, "_CHECKSUMS", "orbax.checkpoint"},
    "everything but the marker": {_META, "_CHECKSUMS", "orbax.checkpoint", "pytree"},
}


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path)
    return request.getfixturevalue("bucket")


def _copy(source: str, target: str, names: set[str]) -> None:
    for name in cp.storage.list_files(source):
        if name.split("/")[0] in names:
            cp.storage.make_dirs(f"{target}/{name}".rpartition("/")[0])
            cp.storage.write_bytes(f"{target}/{name}", cp.storage.read_bytes(f"{source}/{name}"))


def _load(path: str) -> str:
    """What a load of ``path`` says: ``"loaded"``, ``"no checkpoint"`` or ``"damaged"`` (the
    files of a finished checkpoint are missing)."""
    try:
        cp.load_pytree(path)
    except (cp.errors.NotACheckpointError, cp.errors.CheckpointNotFoundError):
        return "no checkpoint"
    except cp.errors.CheckpointError:
        return "damaged"
    return "loaded"


def test_is_checkpoint_agrees_with_the_loads(root) -> None:
    cp.save_pytree(f"{root}/whole", {"w": np.arange(8.0), "step": 3})
    assert cp.is_checkpoint(f"{root}/whole") and _load(f"{root}/whole") == "loaded"
    for i, (case, names) in enumerate(_CASES.items()):
        path = f"{root}/case-{i}"
        _copy(f"{root}/whole", path, names)
        # A checkpoint is never refused as none; anything else never loads.
        assert _load(path) != ("no checkpoint" if cp.is_checkpoint(path) else "loaded"), case
        if _META not in names:  # No save commits without it, here or in Orbax.
            assert not cp.is_checkpoint(path), case
