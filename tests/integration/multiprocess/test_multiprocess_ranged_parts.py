"""Each process of a multi-process load reads its part of an array split across processes as
byte ranges of the stored chunks (``Reader._run_unbounded``), not through TensorStore's zarr3
driver: only the chunks its devices need, in bounded pieces, values bit-exact.

Two real ``jax.distributed`` processes of 2 CPU devices each save, without a budget, one
float32 array sharded by rows over the 4 devices (4 chunks of 4 MiB, at least
``io.UNBOUNDED_STREAM_BYTES`` in all), then load it onto the same sharding and onto a 2x2
mesh (another sharding: each process still holds its own half of the rows). Each process
reports the bytes it read from files (``/proc/self/io``'s ``rchar``: ``preadv`` and
TensorStore's reads alike), those TensorStore's file kvstore read (its metrics: the zarr3
driver's reads and the b-tree's), and its peak RSS growth beyond the shards it holds.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.peak_rss import PROLOGUE

from .launcher import run_job

pytestmark = [pytest.mark.multiprocess, pytest.mark.fast_path]  # Chunks located by our index.

STATE = 16 << 20  # Global: half in each process.
SHARE = STATE // 2

BODY = """
import numpy as np
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

root = sys.argv[1]
rows, cols = 1024, (16 << 20) // 4 // 1024
host = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
devices = np.array(jax.devices())
saved = NamedSharding(Mesh(devices, ("x",)), P("x"))
cp.save_pytree(os.path.join(root, "warm"), {"w": jax.make_array_from_callback(
    (256, cols), saved, lambda i: host[:256][i])})
cp.save_pytree(os.path.join(root, "ckpt"), {"w": jax.make_array_from_callback(
    host.shape, saved, lambda i: host[i])})

def rchar():
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))

def driver_bytes():
    found = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
    return sum(v["value"] for m in found for v in m["values"])

def load(name, sharding, shape=host.shape):
    abstract = {"w": jax.ShapeDtypeStruct(shape, host.dtype, sharding=sharding)}
    return cp.load_pytree(os.path.join(root, name), abstract)

report = {}
square = NamedSharding(Mesh(devices.reshape(2, 2), ("a", "b")), P("a", "b"))
for label, sharding in (("same", saved), ("resharded", square)):
    load("warm", sharding, (256, cols))  # Imports, threads.
    before = (rchar(), driver_bytes())
    loaded, peak = measured(lambda: load("ckpt", sharding), host.nbytes // NUM_PROCESSES)
    report[label] = {"read": rchar() - before[0], "driver": driver_bytes() - before[1],
                     "peak": peak}
    array = loaded["w"]
    report[label]["exact"] = array.sharding == sharding and not array.is_fully_addressable and all(
        np.array_equal(np.asarray(s.data), host[s.index]) for s in array.addressable_shards)
# Onto the other process's devices alone: this process holds no shard of the result.
other = NamedSharding(Mesh(np.array([d for d in devices if d.process_index == 1]), ("x",)), P("x"))
elsewhere = {}
for label, context in (("ranged", cp.Context()), ("driver", cp.Context(
        array_options=cp.options.ArrayOptions(ocdbt_fast_path=False)))):
    with context:
        array = load("warm", other, (256, cols))["w"]
    elsewhere[label] = array.sharding == other and array.dtype == host.dtype and (
        len(array.addressable_shards) == (0 if jax.process_index() == 0 else 2)) and all(
        np.array_equal(np.asarray(s.data), host[:256][s.index]) for s in array.addressable_shards)
print(json.dumps({"loads": report, "elsewhere": elsewhere}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux's /proc/self/io")
def test_each_process_reads_its_part_as_ranges(tmp_path) -> None:
    results = run_job(PROLOGUE + BODY, devices_per_process=2, args=[str(tmp_path)])
    for result in results:
        outcome = json.loads(result.check().stdout.strip().splitlines()[-1])
        # A process that holds no shard of an array still loads it (JAX needs its dtype).
        assert all(outcome["elsewhere"].values()), (result.process_id, outcome["elsewhere"])
        for label, one in outcome["loads"].items():
            assert one["exact"], (result.process_id, label, one)
            # Its own two chunks (and their trailers, the b-tree): not the other process's.
            assert SHARE <= one["read"] < SHARE * 1.2, (result.process_id, label, one)
            # Ranged reads: TensorStore read the b-tree's nodes only, not the chunks.
            assert one["driver"] < SHARE // 8, (result.process_id, label, one)
            # Besides its shards: a few pieces in flight (io.UNBOUNDED_LIMIT at most).
            assert one["peak"] < 2 * SHARE, (result.process_id, label, one)
