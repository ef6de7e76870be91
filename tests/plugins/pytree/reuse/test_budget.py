"""Incremental saves under a host-memory budget (``MemoryOptions(host_bytes=...)``).

A budget cuts arrays into chunks of a piece of it (``io.budget_chunk_shape``). A
reusing save links an array only where its source stored exactly the chunks this
save would write under its own budget; any other array (another budget, another
chunk shape) is written. Every step loads bit-exact, alone, and passes verify.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import checkpointables as cp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpointables import _verification
from checkpointables_pytree import reuse

from .helpers import assert_same, linked_names

pytestmark = pytest.mark.fast_path

MiB = 1 << 20
SMALL = {"frozen.a0", "frozen.a1", "frozen.a2"}  # 128 KiB each: one chunk under any budget.
CHUNKED = {"big", "host_big", "sharded"}  # Several chunks each under an 8 MiB budget.


def _budget(host_bytes: int | None, compressed: bool = False) -> cp.Context:
    return cp.Context(
        memory_options=cp.options.MemoryOptions(host_bytes=host_bytes),
        array_options=cp.options.ArrayOptions(use_compression=compressed),
    )


def _tree(mesh: jax.sharding.Mesh, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
    return {
        "frozen": {
            f"a{i}": jnp.asarray(rng.standard_normal((128, 256), np.float32)) for i in range(3)
        },
        # 2 MiB: two chunks of (256, 1024) under 8 MiB (a piece: 1 MiB), one under 32 MiB.
        "big": jnp.asarray(rng.standard_normal((512, 1024), np.float32)),
        # A length with no divisor near a piece: chunks of 262144, the last one shorter.
        "host_big": rng.standard_normal(700_001).astype(np.float32),
        # 8 MiB in four shards of 2 MiB (each on two devices): two chunks each under 8 MiB.
        "sharded": jax.device_put(rng.standard_normal((1024, 2048)).astype(np.float32), sharding),
        "adapter": jnp.asarray(rng.standard_normal((128, 256), np.float32)),
        "step": 0,
    }


def _next(tree: dict, step: int) -> dict:
    return dict(tree, adapter=tree["adapter"] + 1, step=step)


def _chunk_shapes(step) -> dict[str, list[int]]:
    """Each array's stored chunk shape (its ``zarr.json``), as a load sees it."""
    metadata = cp.pytree_metadata(step).metadata
    flat = jax.tree_util.tree_leaves_with_path(metadata, is_leaf=lambda x: hasattr(x, "storage"))
    return {
        ".".join(str(getattr(k, "key", k)) for k in path): list(m.storage.chunk_shape)
        for path, m in flat
        if getattr(m, "storage", None) is not None
    }


def _problems(step) -> list[str]:
    """What ``checkpointables verify`` finds wrong with ``step`` (its own code, in process)."""
    return [f.problem for f in _verification.verify_checkpoint(step) if f.problem]


def _each_alone(root, trees: dict, seed: int) -> None:
    """Deletes the steps in a random order; after each deletion every other step (hard
    links of the same files) loads bit-exact, with and without a budget, and verifies."""
    work = root.parent / f"{root.name}-alone{seed}"
    shutil.copytree(root, work, copy_function=os.link)  # The same inodes.
    kept = dict(trees)
    for step in random.Random(seed).sample(sorted(kept), len(kept)):
        shutil.rmtree(work / str(step))
        kept.pop(step)
        for other, tree in kept.items():
            assert_same(cp.load_pytree(work / str(other)), tree)
            with _budget(8 * MiB):
                assert_same(cp.load_pytree(work / str(other)), tree)
            assert _problems(work / str(other)) == []


def _alone(root, trees: dict) -> None:
    """Each step as the only one left (a copy of it alone, hard links of its files): it
    loads bit-exact under a budget and verifies."""
    for step, tree in trees.items():
        work = root.parent / f"{root.name}-only{step}" / str(step)
        shutil.copytree(root / str(step), work, copy_function=os.link)
        with _budget(8 * MiB):
            assert_same(cp.load_pytree(work), tree)
        assert _problems(work) == []


def test_a_budgeted_chain_links_unchanged_chunked_arrays_and_each_step_stands_alone(
    tmp_path, mesh_4x2
) -> None:
    tree = _tree(mesh_4x2)
    trees = {}
    root = tmp_path / "run"
    with (
        _budget(8 * MiB),
        cp.training.Checkpointer(root, reuse_unchanged=True) as ckptr,
    ):
        for step in range(4):
            tree = _next(tree, step)
            ckptr.save_pytree(step, tree)
            trees[step] = tree
            reused = ckptr.last_save_stats.bytes_reused
            if step >= 1:  # Step 0 has no source (but records its fingerprints).
                assert linked_names(root / str(step), "state") == SMALL | CHUNKED
                linked = (*tree["frozen"].values(), tree["big"], tree["host_big"], tree["sharded"])
                assert reused == sum(int(a.nbytes) for a in linked)
    shapes = _chunk_shapes(root / "3")
    assert shapes["big"] == [256, 1024] and shapes["host_big"] == [262144]
    assert shapes["sharded"] == [128, 2048]
    data = root / "3" / "state" / "d"
    assert any(os.stat(data / name).st_nlink > 1 for name in os.listdir(data))
    _each_alone(root, trees, seed=1)


@pytest.mark.parametrize("compressed", [False, True])
def test_a_budget_changed_between_steps_writes_what_it_chunks_otherwise(
    tmp_path, mesh_4x2, compressed
):
    # Compressed chunks vary in length: the chunk shape and keys alone decide.
    tree = _tree(mesh_4x2)
    trees = {}
    for step, host_bytes in enumerate([8 * MiB, 8 * MiB, 32 * MiB, None, 8 * MiB]):
        tree = _next(tree, step)
        with _budget(host_bytes, compressed):
            source = tmp_path / str(step - 1) if step else None
            cp.save_pytree(tmp_path / str(step), tree, reuse_from=source)
        trees[step] = tree
    # 32 MiB (a piece: 4 MiB): "big", "host_big" and "sharded"'s shards fit in one chunk,
    # not in 8 MiB's: written. The small arrays are one chunk under either: linked.
    assert linked_names(tmp_path / "2") == SMALL
    # Without a budget: the chunks of 32 MiB's, every one linked.
    assert linked_names(tmp_path / "3") == SMALL | CHUNKED
    assert linked_names(tmp_path / "4") == SMALL
    _alone(tmp_path, trees)


@pytest.mark.parametrize("compressed", [False, True])
def test_a_record_that_misstates_the_chunk_shape_links_nothing_of_it(
    tmp_path, mesh_4x2, compressed
):
    # A source whose record names the unbudgeted chunk shape though it stored a budget's
    # (what an earlier version, linking by the unbudgeted layout, recorded): uncompressed,
    # the chunks' lengths differ; compressed, the record's format is the earlier version's,
    # whose layouts are trusted only where lengths prove them. The array is written, never
    # linked from chunks of another shape.
    tree = _tree(mesh_4x2)
    with _budget(8 * MiB, compressed):
        cp.save_pytree(tmp_path / "1", tree)
        cp.save_pytree(tmp_path / "2", tree, reuse_from=tmp_path / "1")
    path = tmp_path / "2" / "pytree" / reuse.RECORD_FILE
    record = json.loads(path.read_text())
    entry = record["arrays"]["big"]
    signature = json.loads(entry["signature"])
    signature[3] = [512, 1024]  # The unbudgeted chunk shape.
    entry["signature"] = json.dumps(signature)
    record["format"] = 1
    path.write_text(json.dumps(record))
    with _budget(None, compressed):
        cp.save_pytree(tmp_path / "3", tree, reuse_from=tmp_path / "2")
    assert "big" not in linked_names(tmp_path / "3")
    # The others link where their lengths prove their layout: uncompressed.
    assert ("frozen.a0" in linked_names(tmp_path / "3")) == (not compressed)
    shutil.rmtree(tmp_path / "2")
    shutil.rmtree(tmp_path / "1")
    assert_same(cp.load_pytree(tmp_path / "3"), tree)
    assert _problems(tmp_path / "3") == []
