"""Budgeted loads from an object store read the chunks this library wrote as ranged GETs."""

from __future__ import annotations

import checkpointables as cp
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

BUDGET = cp.options.MemoryOptions(host_bytes=cp.options.MIN_HOST_BYTES)  # Pieces of 1 MiB.


@pytest.mark.fast_path  # Chunks located by our own index.
def test_unbudgeted_checkpoint_loads_in_pieces_bit_exact(bucket) -> None:
    devices = np.array(jax.devices())
    saved = NamedSharding(Mesh(devices.reshape(4, 2), ("x", "y")), P("x", None))
    host = np.random.default_rng(5).standard_normal((512, 2048), dtype=np.float32)
    path = f"{bucket}/unbudgeted"
    cp.save_pytree(path, {"w": jax.device_put(host, saved)})  # Chunks of 2 MiB: two pieces.
    wanted = NamedSharding(Mesh(devices.reshape(2, 4), ("x", "y")), P("y", "x"))
    with cp.Context(memory_options=BUDGET):
        for sharding in (None, wanted):
            abstract = {"w": jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=sharding)}
            loaded = cp.load_pytree(path, abstract)
            np.testing.assert_array_equal(np.asarray(loaded["w"]), host)
            if sharding is not None:
                assert loaded["w"].sharding == wanted


@pytest.mark.fast_path  # Chunks located by our own index.
def test_a_truncated_data_object_fails_a_budgeted_load_as_damage(s3, bucket, tmp_path) -> None:
    # A ranged GET past the object's end is refused (HTTP 416): the leaf's damage, not a
    # bare ValueError of TensorStore's.
    from .test_forged_nodes_remote import _upload

    cp.save_pytree(tmp_path / "saved", {"big": np.arange(2 << 20, dtype=np.float32)})
    data = max((tmp_path / "saved" / "pytree" / "d").iterdir(), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    _upload(tmp_path / "saved", s3, f"{bucket}/c")
    with cp.Context(memory_options=BUDGET), pytest.raises(cp.errors.IntegrityError, match="big"):
        cp.load_pytree(f"{bucket}/c")
