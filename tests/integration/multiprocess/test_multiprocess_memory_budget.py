"""A budget (``cp.options.MemoryOptions``) holds in each process of a multi-process save and load.

Two real ``jax.distributed`` processes of 4 CPU devices each save, through a
``Checkpointer``, two arrays sharded over the 8 devices (one stored as bfloat16:
its chunks are cast on the host, streamed), then load them onto another mesh.
Each process reports its peak RSS growth minus the shards it holds, and the
peak staging memory its ``last_save_stats`` reports.
"""

from __future__ import annotations

import json

import pytest

from tests.peak_rss import PROLOGUE

from .launcher import run_job

pytestmark = pytest.mark.multiprocess

BUDGET = 16 << 20
STATE = 256 << 20  # Global: two float32 arrays of 128 MiB, half of each in each process.
SLACK = 64 << 20

BODY = """
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

budget, state_bytes, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rows = 1024
shape = (rows, state_bytes // 2 // 4 // rows)
devices = np.array(jax.devices())
saved = NamedSharding(Mesh(devices.reshape(8, 1), ("a", "b")), P("a", None))
wanted = NamedSharding(Mesh(devices.reshape(2, 4), ("a", "b")), P("b", "a"))
host = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
tree = {k: jax.make_array_from_callback(shape, saved, lambda i: host[i] + n)
        for n, k in enumerate(["w", "c"])}
abstract = {k: jax.ShapeDtypeStruct(shape, np.float32, sharding=wanted) for k in tree}
def storage(keypath, value):
    if jax.tree_util.keystr(keypath) == "['c']":
        return cp.options.ArrayStorageOptions(dtype=jnp.bfloat16)
array_options = cp.options.ArrayOptions(storage_options_creator=storage)
context = cp.Context(memory_options=cp.options.MemoryOptions(host_bytes=budget),
                     array_options=array_options)
report = {}
ckptr = cp.training.Checkpointer(root, context=context)
ckptr.save_pytree(0, {k: v[:64] for k, v in tree.items()})  # Warm-up: compiles, threads.
with context:
    cp.load_pytree(os.path.join(root, "0"),
                   {k: jax.ShapeDtypeStruct((64, shape[1]), np.float32, sharding=wanted)
                    for k in tree})
_, report["save"] = measured(lambda: ckptr.save_pytree(1, tree), 0)
report["reported_peak"] = ckptr.last_save_stats.peak_staging_bytes
ckptr.close()
del tree
own = state_bytes // NUM_PROCESSES
with context:
    loaded, report["load_resharded"] = measured(
        lambda: cp.load_pytree(os.path.join(root, "1"), abstract), own)
expected = {"w": host, "c": (host + 1).astype(jnp.bfloat16).astype(np.float32)}
report["exact"] = all(
    np.array_equal(np.asarray(shard.data), expected[k][shard.index])
    for k, array in loaded.items() for shard in array.addressable_shards)
print(json.dumps(report))
"""


def test_each_process_keeps_the_budget(tmp_path) -> None:
    results = run_job(
        PROLOGUE + BODY,
        devices_per_process=4,
        args=[str(BUDGET), str(STATE), str(tmp_path / "run")],
        timeout=300,
    )
    for result in results:
        report = json.loads(result.check().stdout.strip().splitlines()[-1])
        assert report["exact"], report
        for op in ("save", "load_resharded"):
            assert report[op] <= BUDGET + SLACK, (result.process_id, op, report[op] >> 20, report)
        # The cast chunks of its half of "c", streamed within the budget.
        assert 0 < report["reported_peak"] <= BUDGET, report
