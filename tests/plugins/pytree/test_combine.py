"""Combining process-local saves that hold other shards of the same arrays
(``PyTreeHandler.combine_shards``, the local tier's ``cp.protocols.CombinesShards``)."""

from __future__ import annotations

import asyncio
import os
import shutil

import checkpointables as cp
import jax
import numpy as np
import pytest
import tensorstore as ts
from checkpointables_pytree import PyTreeHandler, record_checksums_again
from etils import epath
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _drop_chunks(checkpoint, keep_rows: int) -> None:
    """Removes from the saved pytree the chunks of ``w`` outside row block ``keep_rows``
    (as if another process had held them), then records its checksums again."""
    base = f"file://{os.path.abspath(checkpoint / 'pytree')}"
    store = ts.KvStore.open({"driver": "ocdbt", "base": base}).result()
    for key in store.list().result():
        if key.startswith(b"w/c/") and not key.startswith(f"w/c/{keep_rows}/".encode()):
            store.delete_range(ts.KvStore.KeyRange(key, key + b"\x00")).result()
    record_checksums_again(checkpoint)


def test_combined_saves_hold_every_shard_of_their_sources(tmp_path, mesh_4x2) -> None:
    sharding = NamedSharding(mesh_4x2, P("x", "y"))
    w = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), sharding)
    tree = {"w": w, "n": np.arange(3)}
    target = tmp_path / "combined"
    target.mkdir()
    sources = []
    for rows in range(4):  # Each source: one row block's chunks of w.
        source = tmp_path / f"saved{rows}"
        cp.save_pytree(source, tree)
        _drop_chunks(source, rows)
        sources.append(target / f".part{rows}")
        shutil.copytree(source / "pytree", sources[-1])
    abstract = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding), "n": np.empty(3)}
    with pytest.raises(cp.errors.IntegrityError, match="missing"):  # One source lacks rows.
        cp.load_pytree(tmp_path / "saved0", abstract)

    handler = PyTreeHandler()
    assert isinstance(handler, cp.protocols.CombinesShards)
    asyncio.run(handler.combine_shards([epath.Path(s) for s in sources], epath.Path(target)))
    checkpoint = tmp_path / "saved0"
    shutil.rmtree(checkpoint / "pytree")
    shutil.move(target, checkpoint / "pytree")
    record_checksums_again(checkpoint)  # The checkpoint's _CHECKSUMS cover the new pytree.
    restored = cp.load_pytree(checkpoint, abstract)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(w), strict=True)
    np.testing.assert_array_equal(restored["n"], np.arange(3))
