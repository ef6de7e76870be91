"""Forged and damaged database files: sizes they declare, nodes they point to, files they name.

A forger may recompute every checksum a file holds (a b-tree node's CRC-32C, the
manifest's) and the ``_CHECKSUMS`` of the checkpoint; a load must still never
allocate what a file declares before checking it against the file, and errors
name the file that is damaged.
"""

from __future__ import annotations

import json
import shutil
import time

import checkpointables as cp
import numpy as np
import pytest
from checkpointables import _verification
from checkpointables_pytree import ocdbt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .damage import forge_root, root_location, saved_by_fast_path

# Forged manifests and nodes of the database our fast path writes and reads.
pytestmark = pytest.mark.fast_path

TREE = {"a": np.arange(3), "step": 5, "big": np.arange(2 << 20, dtype=np.float32)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return saved_by_fast_path(tmp_path_factory, TREE)


def _problems(checkpoint) -> list[str]:
    return [f.problem for f in _verification.verify_checkpoint(checkpoint) if f.problem]


def _exact(loaded) -> bool:
    return loaded["step"] == 5 and all(np.array_equal(loaded[k], TREE[k]) for k in ("a", "big"))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    offset=st.one_of(st.just(0), st.integers(0, 1 << 45)),
    length=st.one_of(st.just(1 << 40), st.integers(0, 1 << 62)),
)
def test_a_forged_root_location_is_checked_against_the_file(saved, tmp_path, offset, length):
    checkpoint = tmp_path / "c"
    shutil.rmtree(checkpoint, ignore_errors=True)
    shutil.copytree(saved, checkpoint)
    forge_root(checkpoint / "pytree", offset, length)
    cp.metadata_checksums.record(checkpoint)  # Recomputed, as a forger could.
    try:
        loaded = cp.load_pytree(checkpoint)
    except cp.errors.IntegrityError as e:
        node_file = root_location(saved / "pytree")[0]
        assert node_file in str(e) or "manifest.ocdbt" in str(e)
        assert _problems(checkpoint)
    else:
        assert _exact(loaded)


@pytest.mark.parametrize("recorded_nodes", [True, False])
def test_a_root_of_one_tebibyte_is_an_integrity_error_naming_the_file(
    saved, tmp_path, recorded_nodes
):
    checkpoint = shutil.copytree(saved, tmp_path / "c")
    forge_root(checkpoint / "pytree", 0, 1 << 40)
    if not recorded_nodes:  # As Orbax writes it.
        (checkpoint / "pytree" / ocdbt.NODE_CHECKSUMS_FILE).unlink()
    # Either way the root's declared size is refused before anything reads it.
    expected = "more than any b-tree node holds"
    cp.metadata_checksums.record(checkpoint)
    node_file = root_location(checkpoint / "pytree")[0]
    with pytest.raises(cp.errors.IntegrityError, match=rf"^\S*{node_file}\S* .*{expected}"):
        cp.load_pytree(checkpoint)


def test_metadata_listing_more_arrays_than_the_database_holds_is_refused_early(saved, tmp_path):
    checkpoint = shutil.copytree(saved, tmp_path / "c")
    file = checkpoint / "pytree" / "_METADATA"
    document = json.loads(file.read_text())
    (entry,) = [v for k, v in document["tree_metadata"].items() if "'a'" in k]
    for i in range(20_000):
        bogus = json.loads(json.dumps(entry))
        bogus["key_metadata"][0]["key"] = f"x{i}"
        document["tree_metadata"][f"('x{i}',)"] = bogus
    file.write_text(json.dumps(document))
    cp.metadata_checksums.record(checkpoint)
    start = time.perf_counter()
    with pytest.raises(cp.errors.MetadataError, match="20,003 arrays.*holds 6 keys"):
        cp.load_pytree(checkpoint)
    assert time.perf_counter() - start < 5  # Parsing only: nothing is planned or read.
    assert any("20,003 arrays" in p for p in _problems(checkpoint))


def test_without_checksum_checks_damage_in_a_large_array_loads_and_verify_finds_it(saved, tmp_path):
    # What docs/pytree.md says of verify_checksums=False: arrays read here are unchecked.
    checkpoint = shutil.copytree(saved, tmp_path / "c")
    data = max((checkpoint / "pytree" / "d").iterdir(), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[4 << 20] ^= 0x10
    data.write_bytes(bytes(raw))
    with cp.Context(array_options=cp.options.ArrayOptions(verify_checksums=False)):
        assert not np.array_equal(cp.load_pytree(checkpoint)["big"], TREE["big"])
    with pytest.raises(cp.errors.IntegrityError, match=r"\['big'\]"):
        cp.load_pytree(checkpoint)
    assert any("['big']" in p for p in _problems(checkpoint))
