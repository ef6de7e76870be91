"""Incremental saves with 2 real jax.distributed processes: each links the shards it writes."""

from __future__ import annotations

import os
import shutil

import checkpointables as cp
import numpy as np
import pytest

from .launcher import run_job

pytestmark = pytest.mark.multiprocess

BODY = """
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
root = sys.argv[1]
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
frozen_value = np.arange(256 * 512, dtype=np.float32).reshape(256, 512)
def make(value, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda i: value[i])
tree = {"frozen": make(frozen_value, P("x", "y")), "w": make(frozen_value * 0, P("x"))}
with cp.training.Checkpointer(root, reuse_unchanged=True) as ckptr:
    for step in range(3):
        tree = dict(tree, w=make(frozen_value * 0 + step, P("x")))
        assert ckptr.save_pytree(step, tree, force=True)
        print("REUSED", step, ckptr.last_save_stats.bytes_reused, flush=True)
"""


def test_each_process_reuses_the_shards_it_writes(tmp_path) -> None:
    results = [r.check() for r in run_job(BODY, args=[str(tmp_path)])]
    frozen = np.arange(256 * 512, dtype=np.float32).reshape(256, 512)
    for result in results:
        lines = [line.split() for line in result.stdout.splitlines() if line.startswith("REUSED")]
        reused = {int(step): int(n) for _, step, n in lines}
        # Each process writes half of "frozen" (one replica of each shard it holds).
        assert reused[0] == 0 and reused[1] == reused[2] == frozen.nbytes // 2
    for index in range(2):
        data = tmp_path / "2" / "state" / f"ocdbt.process_{index}" / "d"
        assert any(os.stat(f).st_nlink > 1 for f in data.iterdir())
    shutil.rmtree(tmp_path / "1")
    shutil.rmtree(tmp_path / "0")
    loaded = cp.load_pytree(tmp_path / "2")
    assert np.asarray(loaded["frozen"]).tobytes() == frozen.tobytes()
    assert np.asarray(loaded["w"]).tobytes() == (frozen * 0 + 2).tobytes()
