"""Typed PRNG keys sharded over two real jax.distributed processes: saved, restored elsewhere."""

from __future__ import annotations

import checkpointables as cp
import jax
import numpy as np
import pytest

from .launcher import run_job

pytestmark = pytest.mark.multiprocess
P = jax.sharding.PartitionSpec

SAVE_AND_RESTORE = """
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
MESH = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
data = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(11, impl="rbg"), 8)))
sharding = NamedSharding(MESH, P("x", None))  # Each process holds half of the keys.
keys = jax.random.wrap_key_data(
    jax.make_array_from_callback(data.shape, sharding, lambda i: data[i]), impl="rbg")
cp.save_pytree(sys.argv[1], {"keys": keys, "rng": jax.random.key(3)})
# Back onto the other axis of the same devices.
target = NamedSharding(MESH, P("y"))
abstract = {"keys": jax.ShapeDtypeStruct((8,), keys.dtype, sharding=target), "rng": None}
loaded = cp.load_pytree(sys.argv[1], abstract)["keys"]
assert loaded.sharding.is_equivalent_to(target, 1) and loaded.dtype == keys.dtype
for shard in loaded.addressable_shards:
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(shard.data)), data[shard.index])
print("KEYS OK", flush=True)
"""


@pytest.mark.slow
def test_keys_sharded_over_two_processes(tmp_path) -> None:
    path = tmp_path / "keys"
    for result in run_job(SAVE_AND_RESTORE, args=[str(path)]):
        result.check()
        assert "KEYS OK" in result.stdout
    expected = jax.random.key_data(jax.random.split(jax.random.key(11, impl="rbg"), 8))
    # In this one process, on the default device, and onto a mesh of its 8 devices.
    loaded = cp.load_pytree(path)
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(loaded["keys"])), expected)
    assert jax.random.uniform(loaded["rng"]) == jax.random.uniform(jax.random.key(3))
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    abstract = cp.pytree_metadata(path).metadata
    abstract["keys"] = jax.ShapeDtypeStruct(
        (8,), abstract["keys"].dtype, sharding=jax.NamedSharding(mesh, P("a"))
    )
    resharded = cp.load_pytree(path, abstract)["keys"]
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(resharded)), expected)
