"""Budgeted loads read the chunks this library wrote as byte ranges (``io._ranged_reads``).

A checkpoint saved without a budget has one chunk per shard: far larger than
the pieces of a small budget (8 MiB: pieces of 1 MiB). Its chunks are read
piece by piece from the data files, straight into the arrays where a piece is
one block of its region, and each chunk's CRC-32C is computed over its pieces:
a damaged chunk fails the load, even where the damage lies in bytes no region
asks for.
"""

from __future__ import annotations

import asyncio
import math

import checkpointables as cp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from checkpointables_pytree import ocdbt, zarr3
from checkpointables_pytree.io import chunk_pieces
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.plugins.pytree.damage import flip

BUDGET = cp.options.MemoryOptions(host_bytes=cp.options.MIN_HOST_BYTES)  # Pieces of 1 MiB.
CHECKSUM = "a chunk's CRC-32C does not match its data"  # Our reader's words, not the driver's.


def _tree(mesh: jax.sharding.Mesh) -> dict:
    rng = np.random.default_rng(3)
    rows = NamedSharding(mesh, P("x", None))
    return {
        # Chunks of 256 x 2048 float32 (2 MiB): two pieces each.
        "w": jax.device_put(rng.standard_normal((1024, 2048), dtype=np.float32), rows),
        # One chunk of 3 MiB whose rows are 1.5 MiB: pieces cut inside rows.
        "bf16": jnp.asarray(rng.standard_normal((2, 786432)), dtype=jnp.bfloat16),
        "odd": jax.device_put(rng.integers(-9, 9, (1028, 3, 301), dtype=np.int16), rows),
        "numpy": rng.integers(0, 255, (1500, 1001), dtype=np.uint8),
    }


def _same(expected: dict, loaded: dict) -> None:
    for key, value in loaded.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(expected[key]), err_msg=key)


@pytest.mark.fast_path
def test_unbudgeted_checkpoint_loads_bit_exact(tmp_path, mesh_4x2, mesh_2x4, one_device) -> None:
    tree = _tree(mesh_4x2)
    cp.save_pytree(tmp_path / "c", tree)
    other = {"w": P("y", "x"), "odd": P("x")}  # (1028, 3, 301): rows split in 2 only.
    onto = {
        "as_saved": tree,
        "one_device": {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=one_device)
            for k, v in tree.items()
            if k != "numpy"
        },
        "resharded": {
            k: jax.ShapeDtypeStruct(
                tree[k].shape, tree[k].dtype, sharding=NamedSharding(mesh_2x4, spec)
            )
            for k, spec in other.items()
        },
    }
    with cp.Context(memory_options=BUDGET):
        for name, abstract in onto.items():
            loaded = cp.load_pytree(tmp_path / "c", abstract, partial_load=True)
            _same(tree, loaded)
            for key, leaf in abstract.items():
                if isinstance(leaf, jax.ShapeDtypeStruct):
                    assert loaded[key].sharding == leaf.sharding, (name, key)


@pytest.mark.fast_path
def test_a_cast_and_a_truncation(tmp_path, mesh_4x2) -> None:
    tree = _tree(mesh_4x2)
    cp.save_pytree(tmp_path / "c", tree)
    abstract = {
        "w": jax.ShapeDtypeStruct((1000, 2000), jnp.bfloat16),
        "numpy": np.empty((1500, 1001), np.int32),
    }
    options = cp.options.ArrayOptions(enable_padding_and_truncation=True)
    with cp.Context(memory_options=BUDGET, array_options=options):
        loaded = cp.load_pytree(tmp_path / "c", abstract, partial_load=True)
    expected = np.asarray(tree["w"])[:1000, :2000].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(loaded["w"]), expected)
    np.testing.assert_array_equal(loaded["numpy"], tree["numpy"].astype(np.int32))


def _chunk_location(path, name: str, index: tuple[int, ...]) -> ocdbt.ValueLocation:
    key = zarr3.chunk_key(name, index).encode()
    found = asyncio.run(ocdbt.DatabaseIndex(path / "pytree").find([key]))
    location = found[key]
    assert isinstance(location, ocdbt.ValueLocation)
    return location


@pytest.mark.fast_path
@pytest.mark.parametrize("where", ["first_byte", "last_piece", "unasked_rows", "index"])
def test_a_damaged_chunk_is_caught(tmp_path, mesh_4x2, where) -> None:
    host = np.random.default_rng(4).standard_normal((1024, 2048), dtype=np.float32)
    tree = {"w": jax.device_put(host, NamedSharding(mesh_4x2, P("x", None)))}
    cp.save_pytree(tmp_path / "c", tree)
    location = _chunk_location(tmp_path / "c", "w", (3, 0))  # Rows 768-1023, 2 MiB.
    chunk_bytes = 256 * 2048 * 4
    offset = {
        "first_byte": 0,
        "last_piece": chunk_bytes - 5,
        "unasked_rows": chunk_bytes - 2048 * 4 * 10,  # Row 1014: truncated away below.
        "index": chunk_bytes + 6,  # The shard index after the data and its CRC-32C.
    }[where]
    flip(tmp_path / "c" / "pytree" / location.file, location.offset + offset)
    abstract = {"w": jax.ShapeDtypeStruct((1000, 2048), jnp.float32)}
    options = cp.options.ArrayOptions(enable_padding_and_truncation=True)
    match = "layout that was written" if where == "index" else CHECKSUM
    with (
        cp.Context(memory_options=BUDGET, array_options=options),
        pytest.raises(cp.errors.IntegrityError, match=match),
    ):
        cp.load_pytree(tmp_path / "c", abstract)
    # Rows the damage does not touch still load (no other chunk is read).
    with cp.Context(memory_options=BUDGET, array_options=options):
        part = {"w": jax.ShapeDtypeStruct((700, 2048), jnp.float32)}
        np.testing.assert_array_equal(
            np.asarray(cp.load_pytree(tmp_path / "c", part)["w"]), host[:700]
        )


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(1, 24), min_size=0, max_size=4),
    itemsize=st.sampled_from([1, 2, 4, 8]),
    most=st.integers(1, 6000),
)
def test_chunk_pieces_tile_the_chunk_in_byte_order(shape, itemsize, most) -> None:
    # At least one element, and at most a few hundred pieces (a fast test).
    most = max(most, itemsize, math.prod(shape) * itemsize // 300)
    elements = np.arange(math.prod(shape)).reshape(shape)
    seen = np.zeros(shape, np.int32)
    position = 0
    for piece, start, length in chunk_pieces(shape, itemsize, most):
        assert start == position
        count = math.prod(s.stop - s.start for s in piece)
        assert length == count * itemsize
        # A contiguous run of the chunk's C-order bytes, at most ``most`` of them.
        first = start // itemsize
        np.testing.assert_array_equal(elements[piece].ravel(), np.arange(first, first + count))
        assert length <= most
        seen[piece] += 1
        position += length
    assert position == math.prod(shape) * itemsize
    assert (seen == 1).all()


@pytest.mark.fast_path
@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.integers(8, 700),
    cols=st.integers(300, 3000),
    dtype=st.sampled_from([np.float32, np.int16, np.float64]),
    saved_split=st.sampled_from([1, 2, 4, 8]),
    wanted=st.sampled_from([P(None, None), P("x", None), P(None, "y"), P("y", "x")]),
)
def test_random_shapes_and_shardings_load_bit_exact(
    tmp_path_factory, mesh_2x4, rows, cols, dtype, saved_split, wanted
) -> None:
    rows = -(-rows // 8) * 8  # Divisible by every mesh axis.
    cols = max(cols, (1 << 20) // (rows * np.dtype(dtype).itemsize) + 1)  # Streamed: > 1 MiB.
    cols = -(-cols // 8) * 8
    host = np.random.default_rng(rows * cols).integers(-1000, 1000, (rows, cols)).astype(dtype)
    devices = np.array(jax.devices()[:saved_split]).reshape(saved_split, 1)
    mesh = jax.sharding.Mesh(devices, ("a", "b"))
    path = tmp_path_factory.mktemp("random") / "c"
    cp.save_pytree(path, {"w": jax.device_put(host, NamedSharding(mesh, P("a", None)))})
    sharding = NamedSharding(mesh_2x4, wanted)
    with cp.Context(memory_options=BUDGET):
        loaded = cp.load_pytree(
            path, {"w": jax.ShapeDtypeStruct(host.shape, dtype, sharding=sharding)}
        )
    assert loaded["w"].sharding == sharding
    np.testing.assert_array_equal(np.asarray(loaded["w"]), host)
