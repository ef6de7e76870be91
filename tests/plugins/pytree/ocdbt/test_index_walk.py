"""``ocdbt.DatabaseIndex`` walks only what a b-tree can be: each node reached once, each
child one level below its parent. A damaged or forged b-tree is an ``IntegrityError``
naming the node's file, never an endless walk (``checkpointables verify`` of a checkpoint
without recorded node checksums, such as Orbax's, walked a self-referencing node forever).
"""

from __future__ import annotations

import asyncio
import os
import struct

import checkpointables as cp
import crc32c
import numpy as np
import pytest
import tensorstore as ts
from checkpointables import _verification
from checkpointables_pytree import ocdbt

from ....metadata_edits import without_metadata_checksums
from ..damage import varint

_MAGIC = 0x0CDB20DE  # TensorStore's "B+tree node format".


def _framed(body: bytes) -> bytes:
    """An uncompressed node of ``body``: header, body, CRC-32C."""
    head = struct.pack(">I", _MAGIC) + struct.pack("<Q", 4 + 8 + 2 + len(body) + 4) + b"\0\0"
    return head + body + struct.pack("<I", crc32c.crc32c(head + body))


def _root(directory) -> tuple[str, int, int]:
    """The (file, offset, length) of the root node of the database in ``directory``."""
    manifest = ocdbt.dump(ts.KvStore.open({"driver": "file", "path": f"{directory}/"}).result())
    latest = max(manifest["versions"], key=lambda v: v["generation_number"])
    base, relative, offset, length = ocdbt.split_location(latest["root"]["location"])
    return base + relative, offset, length


def _make_root_its_own_child(directory) -> str:
    """Rewrites the root node, in place and at its length, as an interior node whose only
    child is itself (its key padded to fill the length); the root's data file."""
    file, offset, length = _root(directory)
    for pad in range(length):
        key = b"\0" * pad  # Below every key: the walk descends into the child.
        files = varint(1) + varint(len(file)) + b"\0" + file.encode()
        entry = varint(1) + varint(len(key)) + b"\0" + key + b"\0" + varint(offset)
        entry += varint(length) + varint(1) + varint(length) + b"\0"
        node = _framed(bytes([1]) + files + entry)
        if len(node) == length:
            break
    else:
        raise AssertionError("no padding fits the root's length")
    with open(os.path.join(directory, file), "r+b") as f:
        f.seek(offset)
        f.write(node)
    return os.path.join(directory, file)


@pytest.mark.fast_path  # Without it TensorStore's own walk reports the node's height.
def test_a_btree_node_that_is_its_own_child_is_reported_by_verify_not_walked_forever(
    tmp_path,
) -> None:
    checkpoint = tmp_path / "ckpt"
    cp.save_pytree(checkpoint, {"a": np.arange(6), "big": np.arange(100_000, dtype=np.float32)})
    without_metadata_checksums(checkpoint)  # As Orbax's, or an older save's.
    (checkpoint / "pytree" / ocdbt.NODE_CHECKSUMS_FILE).unlink()
    node_file = _make_root_its_own_child(checkpoint / "pytree")
    problems = [f.problem for f in _verification.verify_checkpoint(checkpoint) if f.problem]
    cycles = [p for p in problems if "reaches it twice" in p]
    assert cycles
    assert node_file in cycles[0]


def test_a_node_that_is_its_own_child_is_refused_by_the_index(tmp_path) -> None:
    spec = {"driver": "ocdbt", "base": {"driver": "file", "path": f"{tmp_path}/"}}
    store = ts.KvStore.open({**spec, "config": {"compression": None}}).result()
    with ts.Transaction() as transaction:
        for i in range(10):  # Inline values: a root leaf longer than the forged node.
            store.with_transaction(transaction)[f"key{i}"] = b"v" * 50
    node_file = _make_root_its_own_child(tmp_path)
    with pytest.raises(cp.errors.IntegrityError, match="reaches it twice") as raised:
        asyncio.run(ocdbt.DatabaseIndex(tmp_path).find(["key1"]))
    assert node_file in str(raised.value)


def test_a_child_whose_height_is_not_one_below_its_parents_is_refused(tmp_path) -> None:
    spec = {"driver": "ocdbt", "base": {"driver": "file", "path": f"{tmp_path}/"}}
    config = {"compression": None, "max_decoded_node_bytes": 300}  # A root over leaves.
    store = ts.KvStore.open({**spec, "config": config}).result()
    with ts.Transaction() as transaction:
        for i in range(40):
            store.with_transaction(transaction)[f"key{i:03}"] = b"v" * 50
    file, offset, length = _root(tmp_path)
    with open(tmp_path / file, "r+b") as f:  # The root's height byte, one higher.
        f.seek(offset)
        node = bytearray(f.read(length))
        height = node[14]
        assert height >= 1
        node[14] = height + 1
        node[-4:] = struct.pack("<I", crc32c.crc32c(bytes(node[:-4])))
        f.seek(offset)
        f.write(node)
    with pytest.raises(cp.errors.IntegrityError) as raised:
        asyncio.run(ocdbt.DatabaseIndex(tmp_path).find(["key001", "key039"]))
    assert os.fspath(tmp_path / "d") in str(raised.value)
    assert f"but its parent's entry needs height {height}" in str(raised.value)
