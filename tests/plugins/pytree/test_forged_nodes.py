"""Forged b-tree nodes: rebuilt with a valid CRC-32C of their own, found by ``_btree_checksums``.

A node's trailer CRC-32C is recomputed by whoever rewrites it, so a leaf node
rebuilt with the same length can point a key at other bytes and both
TensorStore and our decoder accept it. The save records every node's SHA-256
in ``pytree/_btree_checksums`` (covered by ``_CHECKSUMS``, as the manifest
is): ``verify`` finds any changed node, and a load checks the manifest and
every node before anything (our index or TensorStore) reads the database.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import struct

import checkpointables as cp
import checkpointables_pytree
import crc32c
import numpy as np
import pytest
from checkpointables import _verification
from checkpointables_pytree import ocdbt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ...metadata_edits import without_metadata_checksums
from .damage import saved_by_fast_path

# The saves here choose their own path (FAST_PATH_OFF where TensorStore writes): the
# fast path stays on in CI's run without it.
pytestmark = pytest.mark.fast_path

TREE = {"a": np.arange(3), "step": 5, "big": np.arange(2 << 20, dtype=np.float32)}
FAST_PATH_OFF = cp.Context(array_options=cp.options.ArrayOptions(ocdbt_fast_path=False))


def _problems(checkpoint) -> list[str]:
    return [f.problem for f in _verification.verify_checkpoint(checkpoint) if f.problem]


def _nodes(database) -> list[tuple[str, int, int]]:
    """The (file relative to ``database``, offset, length) of every node of its b-tree."""
    found = []
    for location in sorted(ocdbt.node_checksums(database)):
        base, relative, offset, length = ocdbt.split_location(location)
        found.append((base + relative, offset, length))
    return found


def _rewrite_node(database, node: tuple[str, int, int], change) -> None:
    """Applies ``change`` to the node's bytes (but its trailer) and recomputes its CRC-32C,
    as a forger would."""
    file, offset, length = node
    raw = bytearray((database / file).read_bytes())
    body = bytearray(raw[offset : offset + length - 4])
    change(body)
    raw[offset : offset + length] = body + struct.pack("<I", crc32c.crc32c(bytes(body)))
    (database / file).write_bytes(bytes(raw))


def _forge_step(database) -> str:
    """Rewrites the leaf node holding ``step`` so that its value is 8 bytes of ``big``'s
    data, in a well-formed shard; returns the node's file."""
    (node,) = _nodes(database)
    file, offset, length = node
    leaf = ocdbt.decode((database / file).read_bytes()[offset : offset + length], "")
    assert isinstance(leaf, ocdbt.LeafNode)
    at = int(leaf.inline_at[leaf.keys.index(b"step/c")])
    stolen = np.arange(2 << 20, dtype=np.float32)[10:12].tobytes()  # Another leaf's bytes.
    index = struct.pack("<QQ", 0, 12)
    shard = stolen + struct.pack("<I", crc32c.crc32c(stolen))
    shard += index + struct.pack("<I", crc32c.crc32c(index))

    def change(body: bytearray) -> None:
        assert len(body[at : at + len(shard)]) == len(shard) == 32
        body[at : at + len(shard)] = shard

    _rewrite_node(database, node, change)
    return file


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return saved_by_fast_path(tmp_path_factory, TREE)


def test_a_save_records_every_node_and_the_list_is_covered_by_checksums(saved) -> None:
    listed = (saved / "pytree" / ocdbt.NODE_CHECKSUMS_FILE).read_text()
    assert all(location in listed for location in ocdbt.node_checksums(saved / "pytree"))
    assert f"pytree/{ocdbt.NODE_CHECKSUMS_FILE}" in (saved / "_CHECKSUMS").read_text()
    assert _problems(saved) == []


def test_a_leaf_pointing_step_at_another_leafs_bytes_is_refused(saved, tmp_path) -> None:
    checkpoint = shutil.copytree(saved, tmp_path / "c")
    file = _forge_step(checkpoint / "pytree")
    with pytest.raises(cp.errors.IntegrityError, match=rf"{file}: the b-tree node"):
        cp.load_pytree(checkpoint)
    with FAST_PATH_OFF, pytest.raises(cp.errors.IntegrityError, match=rf"{file}: the b-tree"):
        cp.load_pytree(checkpoint)  # TensorStore would read the forged node.
    with pytest.raises(cp.errors.IntegrityError, match=rf"{file}: the b-tree node"):
        cp.load_pytree(checkpoint, {"a": cp.PLACEHOLDER, "step": 0, "big": cp.PLACEHOLDER})
    problems = _problems(checkpoint)
    assert any(file in p and "_btree_checksums" in p for p in problems), problems


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_changed_byte_of_a_node_is_found(saved, tmp_path, data) -> None:
    checkpoint = tmp_path / "c"
    shutil.rmtree(checkpoint, ignore_errors=True)
    shutil.copytree(saved, checkpoint)
    nodes = _nodes(checkpoint / "pytree")
    node = data.draw(st.sampled_from(nodes))
    position = data.draw(st.integers(0, node[2] - 5))
    bits = data.draw(st.integers(1, 255))

    def change(body: bytearray) -> None:
        body[position] ^= bits

    _rewrite_node(checkpoint / "pytree", node, change)
    with pytest.raises(cp.errors.IntegrityError, match=node[0]):
        cp.load_pytree(checkpoint)
    assert any(node[0] in p for p in _problems(checkpoint))


def _flip_every_node(checkpoint) -> list[str]:
    """Flips a byte in the middle of each node (resealed); returns the nodes' files."""
    files = []
    for node in _nodes(checkpoint / "pytree"):
        middle = node[2] // 2

        def change(body: bytearray, middle: int = middle) -> None:
            body[middle] ^= 0x40

        _rewrite_node(checkpoint / "pytree", node, change)
        files.append(node[0])
    return files


def test_nodes_tensorstore_compressed_are_covered(tmp_path) -> None:
    path = tmp_path / "c"
    with FAST_PATH_OFF:
        cp.save_pytree(path, TREE)
    assert _problems(path) == []
    files = _flip_every_node(path)
    problems = _problems(path)
    assert all(any(f in p for p in problems) for f in files), problems
    with pytest.raises(cp.errors.IntegrityError, match="the b-tree node"):
        cp.load_pytree(path)
    with FAST_PATH_OFF, pytest.raises(cp.errors.IntegrityError, match="the b-tree node"):
        cp.load_pytree(path)  # TensorStore reads every node: they were checked before.


def test_nodes_of_merged_writers_are_covered(tmp_path) -> None:
    path = tmp_path / "c"
    # Two groups of arrays in inner chunks: two writers' databases, merged into the root.
    elements = ocdbt.LARGE_GROUP_BYTES // 4 + 1024
    tree = {f"w{i}": np.full(elements, i, dtype=np.float32) for i in range(2)} | {"step": 3}
    inner = cp.options.ArrayStorageOptions(chunk_byte_size=8 << 20)
    with cp.Context(array_options=cp.options.ArrayOptions(storage_options=inner)):
        cp.save_pytree(path, tree)
    assert len(list((path / "pytree").glob(ocdbt.WRITER_PREFIX + "*"))) == 2
    assert _problems(path) == []
    files = _flip_every_node(path)
    problems = _problems(path)
    assert all(any(f in p for p in problems) for f in files), problems
    with pytest.raises(cp.errors.IntegrityError, match="the b-tree node"):
        cp.load_pytree(path)


def test_nodes_of_a_partial_save_are_covered(tmp_path) -> None:
    path = tmp_path / "c"
    cp.partial.save(path, {"a": np.arange(5)})
    cp.partial.save(path, {"b": np.arange(7.0), "step": 2})
    cp.partial.finalize(path)
    assert (path / "pytree" / ocdbt.NODE_CHECKSUMS_FILE).exists()
    assert _problems(path) == []
    files = _flip_every_node(path)
    problems = _problems(path)
    assert all(any(f in p for p in problems) for f in files), problems
    with pytest.raises(cp.errors.IntegrityError, match="the b-tree node"):
        cp.load_pytree(path)


def test_a_checkpoint_without_the_list_loads_as_before(saved, tmp_path) -> None:
    checkpoint = shutil.copytree(saved, tmp_path / "c")
    (checkpoint / "pytree" / ocdbt.NODE_CHECKSUMS_FILE).unlink()
    cp.metadata_checksums.record(checkpoint)  # As an older version wrote it.
    assert cp.load_pytree(checkpoint)["step"] == 5
    assert _problems(checkpoint) == []


def test_a_changed_manifest_is_refused(saved, tmp_path) -> None:
    checkpoint = shutil.copytree(saved, tmp_path / "c")
    manifest = checkpoint / "pytree" / ocdbt.MANIFEST_FILE
    raw = bytearray(manifest.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    body = bytes(raw[:-4])  # Resealed with its own CRC-32C, as a forger would.
    manifest.write_bytes(body + struct.pack("<I", crc32c.crc32c(body)))
    for context in (cp.Context(), FAST_PATH_OFF):
        with context, pytest.raises(cp.errors.IntegrityError, match="manifest.ocdbt"):
            cp.load_pytree(checkpoint)
    assert any("manifest.ocdbt" in p for p in _problems(checkpoint))


def _commit_a_key(database) -> None:
    """Has TensorStore commit a new version on top of the database (a deliberate rewrite)."""
    store = ocdbt.open_kvstore(database, ocdbt.make_context()).result()
    store.write("extra/key", b"written later").result()


def test_a_database_rewritten_on_purpose_loads_once_its_checksums_are_recorded_again(
    saved, tmp_path
) -> None:
    checkpoint = shutil.copytree(saved, tmp_path / "c")
    _commit_a_key(checkpoint / "pytree")
    with pytest.raises(cp.errors.IntegrityError):
        cp.load_pytree(checkpoint)  # The manifest and the b-tree are no longer the saved ones.
    assert _problems(checkpoint)
    checkpointables_pytree.record_checksums_again(checkpoint)
    for context in (cp.Context(), FAST_PATH_OFF):
        with context:
            assert cp.load_pytree(checkpoint)["step"] == 5
    listed = json.loads((checkpoint / "pytree" / ocdbt.NODE_CHECKSUMS_FILE).read_text())
    assert set(listed["nodes"]) == set(ocdbt.node_checksums(checkpoint / "pytree"))


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast_path", "tensorstore"])
def test_every_zarr_json_is_inline_in_a_node_so_the_node_checksums_cover_it(
    tmp_path, fast_path
) -> None:
    # The zarr.json of an array of every kind (large, compressed, finely chunked, int4).
    tree = {
        "big": np.zeros((64, 32, 16, 8, 4), np.float32),
        "int4": np.arange(10, dtype=np.int8).astype("int4"),
        "step": 3,
        "key": np.arange(7, dtype=np.uint8),
    }
    options = cp.options.ArrayOptions(
        ocdbt_fast_path=fast_path,
        use_compression=True,
        storage_options=cp.options.ArrayStorageOptions(chunk_byte_size=4096),
    )
    with cp.Context(array_options=options):
        cp.save_pytree(tmp_path / "c", tree)
    database = tmp_path / "c" / "pytree"
    values = ocdbt.DatabaseIndex(database)
    found = asyncio.run(values.find([f"{n}/zarr.json" for n in tree]))
    assert set(found) == {f"{n}/zarr.json".encode() for n in tree}
    assert all(isinstance(v, bytes) for v in found.values()), found  # Inline, in a node.


def test_a_lost_manifest_is_an_integrity_error_even_without_metadata_checksums(
    saved, tmp_path
) -> None:
    checkpoint = shutil.copytree(saved, tmp_path / "c")
    without_metadata_checksums(checkpoint)
    (checkpoint / "pytree" / ocdbt.MANIFEST_FILE).unlink()
    for context in (cp.Context(), FAST_PATH_OFF):
        with context, pytest.raises(cp.errors.IntegrityError, match="manifest.ocdbt is missing"):
            cp.load_pytree(checkpoint)
