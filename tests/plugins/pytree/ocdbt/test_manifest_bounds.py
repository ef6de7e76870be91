"""A ``manifest.ocdbt`` or b-tree node location of many GiB is refused before it is read.

TensorStore reads a database's manifest whole whenever it opens it, and a node's
bytes whole: a hostile checkpoint with a 2 GiB (sparse) manifest, or a node whose
location claims 2 GiB, would cost that much memory. Loads (fast path or not),
``pytree_metadata`` and ``checkpointables verify`` refuse them first, naming the
file. Sparse files keep these tests fast.
"""

from __future__ import annotations

import os
import shutil

import checkpointables as cp
import numpy as np
import pytest
from checkpointables import _verification
from checkpointables_pytree import ocdbt

from ....integration.object_store.conftest import bucket, s3, s3_server  # noqa: F401
from ....metadata_edits import without_metadata_checksums
from ..damage import forge_root, root_location

STATE = {"a": np.arange(6, dtype=np.float32), "b": np.ones(3, np.int32)}
HUGE = 2 << 30
PATHS = {
    "fast": cp.Context(),
    "driver": cp.Context(array_options=cp.options.ArrayOptions(ocdbt_fast_path=False)),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The same tree saved by Orbax and by this library: ``{kind: checkpoint}``."""
    from orbax.checkpoint import v1 as ocp_v1

    root = tmp_path_factory.mktemp("saved")
    ocp_v1.save(root / "orbax", STATE)
    cp.save_pytree(root / "own", STATE)
    return {"orbax": (root / "orbax", "state"), "own": (root / "own", "pytree")}


def _huge_manifest(saved, kind: str, target):
    source, pytree = saved[kind]
    shutil.copytree(source, target)
    manifest = target / pytree / ocdbt.MANIFEST_FILE
    os.truncate(manifest, HUGE)  # Sparse: no disk, no time.
    return target, manifest


def _problems(checkpoint) -> list[str]:
    return [f.problem for f in _verification.verify_checkpoint(checkpoint) if f.problem]


@pytest.mark.orbax
@pytest.mark.parametrize("kind", ["orbax", "own"])
def test_a_huge_manifest_is_refused_by_loads_metadata_and_verify(saved, tmp_path, kind) -> None:
    checkpoint, manifest = _huge_manifest(saved, kind, tmp_path / "c")
    calls = [lambda: cp.pytree_metadata(checkpoint)] if kind == "orbax" else []
    for context in PATHS.values():
        calls.append(lambda context=context: _load(checkpoint, context))
    for call in calls:
        # Ours: _CHECKSUMS notices the change first (IntegrityError); Orbax's: the bound.
        with pytest.raises((cp.errors.MetadataError, cp.errors.IntegrityError)) as raised:
            call()
        assert str(manifest) in str(raised.value)
        if kind == "orbax":
            assert isinstance(raised.value, cp.errors.MetadataError)
            assert f"holds more than {ocdbt.MAX_MANIFEST_BYTES:,} bytes" in str(raised.value)
    problems = _problems(checkpoint)
    assert problems and str(manifest) in problems[0], problems


def _load(checkpoint, context: cp.Context):
    with context:
        return cp.load_pytree(checkpoint)


def test_a_manifest_within_the_bound_passes_and_one_above_is_refused(tmp_path) -> None:
    database = tmp_path / "db"
    database.mkdir()
    ocdbt.check_manifest_size(database)  # None yet: the reads report that.
    manifest = database / ocdbt.MANIFEST_FILE
    manifest.touch()
    os.truncate(manifest, ocdbt.MAX_MANIFEST_BYTES)
    ocdbt.check_manifest_size(database)
    os.truncate(manifest, ocdbt.MAX_MANIFEST_BYTES + 1)
    with pytest.raises(cp.errors.MetadataError, match="holds more than") as raised:
        ocdbt.check_manifest_size(database)
    assert str(manifest) in str(raised.value)


def test_a_huge_manifest_on_an_object_store_is_refused_after_one_byte(bucket) -> None:  # noqa: F811
    path = f"{bucket}/ckpt"
    cp.save_pytree(path, STATE)
    manifest = f"{path}/pytree/{ocdbt.MANIFEST_FILE}"
    # Just above the bound (the server keeps it in memory): refused, and never downloaded.
    cp.storage.write_bytes(manifest, b"\0" * (ocdbt.MAX_MANIFEST_BYTES + 1))
    with pytest.raises((cp.errors.MetadataError, cp.errors.IntegrityError)) as raised:
        cp.load_pytree(path)
    assert manifest in str(raised.value)
    with pytest.raises(cp.errors.MetadataError, match="holds more than"):
        ocdbt.check_manifest_size(f"{path}/pytree")


@pytest.mark.fast_path  # forge_root rewrites the manifest the fast path writes (uncompressed).
def test_a_root_node_claiming_gibibytes_is_refused_before_it_is_read(tmp_path) -> None:
    # A manifest (without recorded checksums, as Orbax's) whose root is 2 GiB of a sparse file.
    checkpoint = tmp_path / "c"
    cp.save_pytree(checkpoint, STATE)
    without_metadata_checksums(checkpoint)
    database = checkpoint / "pytree"
    (database / ocdbt.NODE_CHECKSUMS_FILE).unlink()
    huge = database / root_location(database)[0]
    os.truncate(huge, HUGE)  # Its node, then a sparse tail: the forged root claims it all.
    forge_root(database, 0, HUGE)
    for context in PATHS.values():
        with pytest.raises(cp.errors.IntegrityError, match="more than any b-tree node") as e:
            _load(checkpoint, context)
        assert str(huge) in str(e.value)
    # Refused by the bound, before any read (the process's peak memory, which other tests
    # in it set, proves nothing here).
    problems = _problems(checkpoint)
    assert problems and str(huge) in problems[0], problems


@pytest.mark.orbax
def test_metadata_of_an_orbax_checkpoint_on_an_object_store_refuses_a_huge_manifest(
    saved,
    bucket,  # noqa: F811
) -> None:
    # Orbax records no shapes or dtypes: its metadata reads each zarr.json through TensorStore.
    source, pytree = saved["orbax"]
    path = f"{bucket}/orbax"
    for file in source.rglob("*"):
        if file.is_file():
            cp.storage.write_bytes(f"{path}/{file.relative_to(source)}", file.read_bytes())
    manifest = f"{path}/{pytree}/{ocdbt.MANIFEST_FILE}"
    cp.storage.write_bytes(manifest, b"\0" * (ocdbt.MAX_MANIFEST_BYTES + 1))
    with pytest.raises(cp.errors.MetadataError, match="holds more than") as raised:
        cp.pytree_metadata(path)
    assert manifest in str(raised.value)
