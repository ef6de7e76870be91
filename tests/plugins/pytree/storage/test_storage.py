"""The storage layer: CRC-32C, zarr3 encoding identical to TensorStore's, storage options."""

from __future__ import annotations

import json

import checkpointables as cp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from checkpointables_pytree import choose_inner_chunk_shape, leaves, zarr3
from checkpointables_pytree.zarr3 import encode_shard, metadata_dict, zarr_json
from crc32c import crc32c


def test_crc32c_known_values() -> None:
    # RFC 3720 (iSCSI) test vectors.
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(bytes(32)) == 0x8A9136AA
    assert crc32c(b"\xff" * 32) == 0x62A8AB43
    assert crc32c(bytes(range(32))) == 0x46DD794E


@pytest.mark.parametrize(
    ("shape", "dtype", "chunk"),
    [
        ((2, 3), np.float32, (2, 3)),
        ((), np.int64, ()),
        ((4,), np.bool_, (4,)),
        ((5,), np.uint8, (5,)),
        ((3,), ml_dtypes.bfloat16, (3,)),
        ((2,), np.complex64, (2,)),
        ((0, 5), np.float32, (1, 5)),
        ((8, 6), np.float64, (4, 3)),
    ],
)
def test_zarr_json_is_byte_identical_to_tensorstores(shape, dtype, chunk) -> None:
    store = ts.open(
        {
            "driver": "zarr3",
            "kvstore": "memory://",
            "metadata": metadata_dict(shape, dtype, chunk),
            "create": True,
        },
        context=ts.Context(),
    ).result()
    assert store.kvstore.read("zarr.json").result().value == zarr_json(shape, dtype, chunk)


def test_encoded_shards_read_back_through_the_zarr3_driver() -> None:
    context = ts.Context()
    kvstore = ts.KvStore.open("memory://", context=context).result()
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    kvstore.write("zarr.json", zarr_json(values.shape, values.dtype, (2, 4))).result()
    for index, part in (
        (0, values[:2]),
        (1, np.concatenate([values[2:], np.zeros((1, 4), np.float32)])),
    ):
        kvstore.write(f"c/{index}/0", encode_shard(part.tobytes(), crc32c(part.tobytes()))).result()
    store = ts.open({"driver": "zarr3", "kvstore": "memory://"}, context=context).result()
    np.testing.assert_array_equal(store.read().result(), values)
    # A wrong checksum is caught by the driver too.
    kvstore.write("c/0/0", encode_shard(values[:2].tobytes(), 1234)).result()
    store = ts.open({"driver": "zarr3", "kvstore": "memory://"}, context=context).result()
    with pytest.raises(ValueError, match="DATA_LOSS"):
        store.read().result()


@pytest.mark.parametrize(
    ("shape", "itemsize", "target", "axes", "expected"),
    [
        ((1024, 1024), 4, 1 << 20, (), (512, 512)),  # the largest axis is split first
        ((1024, 1024), 4, 1 << 20, (1,), (1024, 256)),  # shard_axes are split first
        ((6, 10), 8, 100, (), (3, 2)),
        ((7,), 4, 8, (), (1,)),  # a prime only splits down to 1
        ((16, 16), 4, 1 << 30, (), (16, 16)),
        # A prime length is not split into chunks of a few bytes: one chunk, over the target.
        ((1000003,), 4, 3 << 20, (), (1000003,)),
        ((3, 7 * (1 << 20) + 1), 1, 3 << 20, (), (1, 7 * (1 << 20) + 1)),
        ((2, 1000003), 4, 3 << 20, (), (1, 1000003)),
    ],
)
def test_choose_inner_chunk_shape(shape, itemsize, target, axes, expected) -> None:
    chunk = choose_inner_chunk_shape(shape, itemsize, target, axes)
    assert chunk == expected
    assert all(s % c == 0 for s, c in zip(shape, chunk, strict=True))
    size = np.prod(chunk) * itemsize
    assert size <= target or chunk == (1,) * len(shape) or size * 16 >= target


def test_inner_chunk_shape_is_the_zarr3_rooms_one_definition() -> None:
    # The leaf handlers write it and reuse checks a source against it: one function.
    assert choose_inner_chunk_shape is zarr3.choose_inner_chunk_shape
    assert leaves.choose_inner_chunk_shape is zarr3.choose_inner_chunk_shape
    assert zarr3.inner_chunk_shape((1024, 1024), 4, 1 << 20, (1,)) == (1024, 256)
    assert zarr3.inner_chunk_shape((16, 16), 4, 1 << 20) is None  # One inner chunk.
    assert zarr3.inner_chunk_shape((1024, 1024), 4, None) is None  # No chunk_byte_size.


def _zarr_metadata(path, name: str) -> dict:
    kvstore = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/pytree"}).result()
    return json.loads(kvstore.read(f"{name}/zarr.json").result().value)


def test_storage_options_dtype_chunks_and_compression(tmp_path) -> None:
    values = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    options = cp.options.ArrayOptions(
        storage_options=cp.options.ArrayStorageOptions(chunk_byte_size=8 * 1024, shard_axes=(1,)),
        storage_options_creator=lambda keypath, value: (
            cp.options.ArrayStorageOptions(dtype=jnp.bfloat16)
            if keypath[-1].key == "half"
            else None
        ),
        use_compression=True,
    )
    with cp.Context(array_options=options):
        cp.save_pytree(tmp_path / "c", {"chunked": values, "half": values, "small": np.arange(3)})
    chunked = _zarr_metadata(tmp_path / "c", "chunked")
    (sharding,) = chunked["codecs"]
    assert sharding["configuration"]["chunk_shape"] == [64, 32]  # 8 KiB, split along axis 1 first
    assert [c["name"] for c in sharding["configuration"]["codecs"]] == ["bytes", "zstd", "crc32c"]
    assert _zarr_metadata(tmp_path / "c", "half")["data_type"] == "bfloat16"
    loaded = cp.load_pytree(tmp_path / "c")
    np.testing.assert_array_equal(loaded["chunked"], values)
    assert loaded["half"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(loaded["half"], values.astype(jnp.bfloat16))
    assert cp.pytree_metadata(tmp_path / "c").metadata["chunked"].storage.chunk_shape == (64, 128)


def test_storage_options_creator_sees_key_paths_and_values(tmp_path) -> None:
    seen = []

    def creator(keypath, value):
        seen.append((jax.tree_util.keystr(keypath), type(value).__name__))
        return None

    with cp.Context(array_options=cp.options.ArrayOptions(storage_options_creator=creator)):
        cp.save_pytree(tmp_path / "c", {"a": {"b": np.ones(2)}, "j": jnp.ones(2)})
    assert sorted(seen) == [("['a']['b']", "ndarray"), ("['j']", "ArrayImpl")]


def test_storage_options_creator_must_return_storage_options(tmp_path) -> None:
    options = cp.options.ArrayOptions(storage_options_creator=lambda keypath, value: "float16")
    with (
        cp.Context(array_options=options),
        pytest.raises(TypeError, match="ArrayStorageOptions or None"),
    ):
        cp.save_pytree(tmp_path / "c", {"a": np.ones(2)})
