"""Every b-tree node a read may reach has its location bounded before it is read.

A checkpoint without ``_btree_checksums`` (Orbax's, or this library's before
it) has no list of the nodes its save wrote. TensorStore reads a node whole,
as long as its parent's entry says: a forged interior node whose child claims
a GiB of a sparse file would cost that GiB, wherever TensorStore walks the
b-tree (the fast path off, a zarr3 driver read, the warming read of a load of a
few values). Loads bound every node's location from the root first, reading
only interior nodes (none in a tree of one node, as a few arrays' is).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct

import checkpointables as cp
import checkpointables_pytree
import crc32c
import numpy as np
import pytest
import tensorstore as ts
from checkpointables_pytree import ocdbt

from ....metadata_edits import without_metadata_checksums
from ....peak_rss import run_child
from ..damage import root_location, varint

STATE = {"a": np.arange(6, dtype=np.float32), "b": np.ones(3, np.int32)}
HUGE = 1 << 30
PATHS = {
    "fast": cp.Context(array_options=cp.options.ArrayOptions(ocdbt_fast_path=True)),
    "driver": cp.Context(array_options=cp.options.ArrayOptions(ocdbt_fast_path=False)),
}


def _multi_level(directory, *, compressed: bool) -> pathlib.Path:
    """A checkpoint of ``STATE`` without recorded checksums whose database TensorStore
    rewrote into nodes of a few entries each (a b-tree of several levels)."""
    checkpoint = directory / "c"
    cp.save_pytree(checkpoint, STATE)
    without_metadata_checksums(checkpoint)
    database = checkpoint / "pytree"
    (database / ocdbt.NODE_CHECKSUMS_FILE).unlink(missing_ok=True)
    spec = {"driver": "ocdbt", "base": f"file://{database}/"}
    old = ts.KvStore.open(spec).result()
    values = {key: old.read(key).result().value for key in old.list().result()}
    (database / ocdbt.MANIFEST_FILE).unlink()
    shutil.rmtree(database / "d")
    config = {"max_decoded_node_bytes": 200, "max_inline_value_bytes": 1024}
    if not compressed:
        config["compression"] = None
    new = ts.KvStore.open({**spec, "config": config}).result()
    with ts.Transaction() as transaction:
        for key, value in values.items():
            new.with_transaction(transaction).write(key, value).result()
    return checkpoint


def _height(database) -> int:
    base = ts.KvStore.open(f"file://{database}/").result()
    return int(ts.ocdbt.dump(base).result()["versions"][-1]["root_height"])


def _with_first_child(node: bytes, offset: int | None, length: int) -> bytes:
    """The uncompressed interior ``node`` with its first child's location moved to
    ``offset`` (``None``: unchanged) and ``length``, with a valid CRC-32C (as a forger
    would write it)."""
    # The offsets column, then the lengths column (TensorStore's "B+tree node format").
    children = [ocdbt.split_location(e["location"]) for e in ocdbt.decode(node, "")]  # type: ignore[union-attr]
    offsets, lengths = [c[2] for c in children], [c[3] for c in children]
    columns = b"".join(map(varint, offsets + lengths))
    assert node.count(columns) == 1
    offsets[0] = offsets[0] if offset is None else offset
    lengths[0] = length
    start = node.index(columns)
    body = node[12:start] + b"".join(map(varint, offsets + lengths))
    body += node[start + len(columns) : -4]
    forged = node[:4] + struct.pack("<Q", 12 + len(body) + 4) + body
    return forged + struct.pack("<I", crc32c.crc32c(forged))


def _node_at(database, location: str) -> tuple[pathlib.Path, int, bytes]:
    base, relative, offset, length = ocdbt.split_location(location)
    file = database / (base + relative)
    return file, offset, file.read_bytes()[offset : offset + length]


def _first_child(node: bytes) -> str:
    return ocdbt.decode(node, "")[0]["location"]  # type: ignore[index]


def _forge_grandchild(database, length: int) -> pathlib.Path:
    """Makes the root's first child (an interior node, rewritten at the end of its file)
    claim ``length`` bytes for its own first child, which its (sparse) data file then
    holds; the root is rewritten in place, the same size, so the manifest is unchanged.
    Returns the file of that claimed child."""
    file, offset, size = root_location(database)
    root_file, _, root = _node_at(database, f"btreenode::{file}:{offset}:{size}")
    child_file, _, child = _node_at(database, _first_child(root))
    holder, held_at, _ = _node_at(database, _first_child(child))
    forged = _with_first_child(child, None, length)
    with open(child_file, "ab") as f:
        at_end = f.tell()
        f.write(forged)
    forged_root = _with_first_child(root, at_end, len(forged))
    assert len(forged_root) == size  # The manifest's location of the root still holds.
    with open(root_file, "r+b") as f:
        f.seek(offset)
        f.write(forged_root)
    os.truncate(holder, max(holder.stat().st_size, held_at + length))  # Sparse.
    return holder


def _load(checkpoint, context: cp.Context):
    with context:
        return cp.load_pytree(checkpoint)


@pytest.mark.parametrize("compressed", [False, True])
def test_a_tree_of_several_levels_loads_both_ways(tmp_path, compressed) -> None:
    checkpoint = _multi_level(tmp_path, compressed=compressed)
    database = checkpoint / "pytree"
    assert _height(database) >= 2
    read = ocdbt.check_manifest(database)
    # Uncompressed interior nodes are handed to the index; compressed ones are dump's.
    assert bool(read) is not compressed
    for context in PATHS.values():
        loaded = _load(checkpoint, context)
        for key, value in STATE.items():
            np.testing.assert_array_equal(loaded[key], value)


def test_a_forged_interior_node_is_refused_before_its_child_is_read(tmp_path) -> None:
    checkpoint = _multi_level(tmp_path, compressed=False)
    holder = _forge_grandchild(checkpoint / "pytree", HUGE)
    for name, context in PATHS.items():
        with pytest.raises(cp.errors.IntegrityError, match="more than any b-tree node") as e:
            _load(checkpoint, context)
        assert str(holder) in str(e.value), name


_LOAD_PEAKS = """
import checkpointables as cp
peaks = {}
for path in sys.argv[1:]:
    for fast in (True, False):
        context = cp.Context(array_options=cp.options.ArrayOptions(ocdbt_fast_path=fast))
        def load():
            with context:
                try:
                    cp.load_pytree(path)
                except cp.errors.IntegrityError as e:
                    return str(e)
            return "loaded"
        peaks[f"{path} fast={fast}"] = measured(load, 0)
print(json.dumps(peaks))
"""


def test_a_forged_interior_node_costs_no_memory_with_the_fast_path_on_or_off(tmp_path) -> None:
    # Without recorded node checksums (the bound refuses it), and with them (the check
    # refuses it: before the warming read of a few values' load, too, which would read
    # the forged node's child whole).
    unlisted = _multi_level(tmp_path / "unlisted", compressed=False)
    listed = _multi_level(tmp_path / "listed", compressed=False)
    checkpointables_pytree.record_checksums_again(listed)
    refused = {}
    for checkpoint in (unlisted, listed):
        holder = _forge_grandchild(checkpoint / "pytree", HUGE)
        refused[str(checkpoint)] = (str(holder), "more than any b-tree node")
    refused[str(listed)] = (str(listed / "pytree" / "d"), "does not match its checksum")
    peaks = run_child(_LOAD_PEAKS, str(unlisted), str(listed), devices=1)
    for which, (outcome, peak) in peaks.items():
        assert peak < 128 << 20, (which, peak, outcome)  # Not the GiB the child claims.
        named, problem = refused[which.split(" ")[0]]
        assert named in outcome and problem in outcome, (which, outcome)


@pytest.mark.orbax
def test_an_orbax_checkpoint_of_a_few_arrays_is_bounded_without_reading_a_node(tmp_path) -> None:
    from orbax.checkpoint import v1 as ocp_v1

    ocp_v1.save(tmp_path / "orbax", STATE)
    database = tmp_path / "orbax" / "state"
    assert _height(database) == 0  # One node, the root: its location is in the manifest.
    assert ocdbt.bound_nodes(database) == {}
    for context in PATHS.values():
        loaded = _load(tmp_path / "orbax", context)
        for key, value in STATE.items():
            np.testing.assert_array_equal(loaded[key], value)
    assert json.loads((database / "_METADATA").read_text())  # Orbax's, untouched.
