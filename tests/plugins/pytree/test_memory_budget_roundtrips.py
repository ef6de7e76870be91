"""Round trips under ``cp.options.MemoryOptions``: every kind of array leaf, bit-exact.

The smallest budget (8 MiB: pieces of 1 MiB) makes arrays of a few MiB
stream in many chunks and pieces; the checkpoints load without a budget too
(the same format), and verify.
"""

from __future__ import annotations

import checkpointables as cp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from checkpointables_pytree.io import pieces
from checkpointables_pytree.leaves import DeviceSink, streamed_host_block
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ...python_subprocess import assert_verifies

BUDGET = cp.options.MemoryOptions(host_bytes=cp.options.MIN_HOST_BYTES)


def _tree(mesh: jax.sharding.Mesh) -> dict:
    rng = np.random.default_rng(1)
    return {
        "sharded": jax.device_put(
            rng.standard_normal((512, 1030), dtype=np.float32), NamedSharding(mesh, P("x", "y"))
        ),
        "prime": jnp.arange(1_000_003, dtype=jnp.int32),  # Chunks of one divisor: 1.
        "bf16": jnp.asarray(rng.standard_normal((1024, 700)), dtype=jnp.bfloat16),
        "numpy": rng.integers(0, 255, (3000, 1000), dtype=np.uint8),
        "small": jnp.ones((3, 4)),
        "empty": jnp.zeros((0, 5)),
        "scalar": 7,
        "text": "kept",
    }


def _same(a: dict, b: dict) -> None:
    for key in a:
        if key in ("scalar", "text"):
            assert a[key] == b[key]
        else:
            np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)


@pytest.mark.parametrize("compression", [False, True])
def test_round_trip_as_saved_and_resharded(tmp_path, mesh_4x2, mesh_2x4, compression) -> None:
    tree = _tree(mesh_4x2)
    path = tmp_path / "ckpt"
    array_options = cp.options.ArrayOptions(use_compression=compression)
    with cp.Context(memory_options=BUDGET, array_options=array_options):
        cp.save_pytree(path, tree)
        _same(tree, cp.load_pytree(path))
        wanted = NamedSharding(mesh_2x4, P("y", "x"))
        abstract = jax.tree.map(
            lambda x: (
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=wanted)
                if isinstance(x, jax.Array) and x.ndim == 2 and x.size > 1000
                else x
            ),
            tree,
        )
        abstract["numpy"] = np.empty((3000, 1000), np.int16)  # A cast on load.
        loaded = cp.load_pytree(path, abstract)
        assert loaded["sharded"].sharding == wanted
        assert loaded["numpy"].dtype == np.int16
        _same({k: v for k, v in tree.items() if k != "numpy"}, loaded)
        np.testing.assert_array_equal(loaded["numpy"], tree["numpy"].astype(np.int16))
    _same(tree, cp.load_pytree(path))  # Without a budget: the same format.
    assert_verifies(path)


def test_async_save_survives_deleting_the_arrays(tmp_path, mesh_4x2) -> None:
    tree = _tree(mesh_4x2)
    expected = jax.tree.map(np.asarray, tree)
    with cp.Context(memory_options=BUDGET):
        response = cp.save_pytree_async(tmp_path / "a", tree)
        for leaf in jax.tree.leaves(tree):
            if isinstance(leaf, jax.Array):
                leaf.delete()
        response.result()
    _same(expected, cp.load_pytree(tmp_path / "a"))


def test_unbudgeted_checkpoint_loads_within_a_budget(tmp_path, mesh_4x2, mesh_2x4) -> None:
    """Chunks larger than a piece (written without a budget) are read in pieces."""
    tree = _tree(mesh_4x2)
    cp.save_pytree(tmp_path / "c", tree)
    wanted = NamedSharding(mesh_2x4, P(None, "x"))
    abstract = {"sharded": jax.ShapeDtypeStruct((512, 1030), jnp.float32, sharding=wanted)}
    with cp.Context(memory_options=BUDGET):
        loaded = cp.load_pytree(tmp_path / "c", abstract, partial_load=True)
    np.testing.assert_array_equal(np.asarray(loaded["sharded"]), np.asarray(tree["sharded"]))


def test_accelerator_paths_on_cpu(mesh_2x4) -> None:
    """What accelerators run (device-side slices, in-place updates of device buffers)."""
    host = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    array = jnp.asarray(host)
    block = streamed_host_block(array, (8, 10), (16, 20), np.dtype(np.float32))
    np.testing.assert_array_equal(block, host[8:24, 10:30])  # A device-side slice.
    sharding = NamedSharding(mesh_2x4, P("x", "y"))
    indices = sharding.addressable_devices_indices_map(host.shape)
    bounds = dict.fromkeys(
        tuple(s.indices(d)[:2] for s, d in zip(i, host.shape, strict=True))
        for i in indices.values()
    )
    regions = [tuple(slice(*b) for b in region) for region in bounds]
    sink = DeviceSink(host.shape, None, sharding, regions, host.dtype, on_host=False)
    for n, region in enumerate(regions):
        for piece in pieces(region, (5, 5), 4, 100):
            offset = tuple(p.start - r.start for p, r in zip(piece, region, strict=True))
            jax.block_until_ready(sink.put(n, offset, host[piece]))
    built = sink.finish()
    assert built.sharding == sharding
    np.testing.assert_array_equal(np.asarray(built), host)


def test_int4_and_dtypes_of_ml_dtypes(tmp_path) -> None:
    tree = {"i4": jnp.asarray(np.arange(4_000_000) % 8 - 4, dtype=ml_dtypes.int4)}
    with cp.Context(memory_options=BUDGET):
        cp.save_pytree(tmp_path / "i4", tree)
        loaded = cp.load_pytree(tmp_path / "i4")
    np.testing.assert_array_equal(np.asarray(loaded["i4"]), np.asarray(tree["i4"]))


def test_a_stored_dtype_cast_is_streamed_chunk_by_chunk(tmp_path, mesh_4x2) -> None:
    """A cast makes copies: the writer fetches (and casts) each chunk when its turn comes."""
    host = np.random.default_rng(2).standard_normal((512, 2048), dtype=np.float32)
    tree = {"w": jax.device_put(host, NamedSharding(mesh_4x2, P("x", "y")))}
    storage = cp.options.ArrayStorageOptions(dtype=np.float16)
    with cp.Context(
        memory_options=BUDGET, array_options=cp.options.ArrayOptions(storage_options=storage)
    ):
        cp.save_pytree(tmp_path / "f16", tree)
        loaded = cp.load_pytree(tmp_path / "f16")
    assert loaded["w"].dtype == np.float16
    np.testing.assert_array_equal(np.asarray(loaded["w"]), host.astype(np.float16))
