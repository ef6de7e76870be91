"""Incremental saves with 2 real jax.distributed processes: each links the shards it writes
(hard links on a local disk, server-side copies on the S3 test server)."""

from __future__ import annotations

import os
import shutil

import checkpointables as cp
import numpy as np
import pytest

from ...object_store_server import S3Server, aws_environment
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
        stats = ckptr.last_save_stats
        print("REUSED", step, stats.bytes_reused, stats.bytes_written, flush=True)
"""


FROZEN = np.arange(256 * 512, dtype=np.float32).reshape(256, 512)


def _check_reused(results) -> None:
    for result in results:
        lines = [line.split() for line in result.stdout.splitlines() if line.startswith("REUSED")]
        reused = {int(step): int(n) for _, step, n, _ in lines}
        written = {int(step): int(n) for _, step, _, n in lines}
        # Each process links half of "frozen" (one replica of each shard it holds); each
        # reports the checkpoint's: "w" written, all of "frozen" reused.
        assert reused[0] == 0 and reused[1] == reused[2] == FROZEN.nbytes
        assert written[0] == 2 * FROZEN.nbytes and written[1] == written[2] == FROZEN.nbytes


def _check_loaded(path) -> None:
    loaded = cp.load_pytree(path)
    assert np.asarray(loaded["frozen"]).tobytes() == FROZEN.tobytes()
    assert np.asarray(loaded["w"]).tobytes() == (FROZEN * 0 + 2).tobytes()


def test_each_process_reuses_the_shards_it_writes(tmp_path) -> None:
    _check_reused([r.check() for r in run_job(BODY, args=[str(tmp_path)])])
    for index in range(2):
        data = tmp_path / "2" / "state" / f"ocdbt.process_{index}" / "d"
        assert any(os.stat(f).st_nlink > 1 for f in data.iterdir())
    shutil.rmtree(tmp_path / "1")
    shutil.rmtree(tmp_path / "0")
    _check_loaded(tmp_path / "2")


def test_on_s3_each_process_copies_the_shards_it_writes(monkeypatch) -> None:
    server = S3Server()
    try:
        for name, value in aws_environment(server.endpoint).items():
            monkeypatch.setenv(name, value)
        bucket = server.new_bucket()
        _check_reused([r.check() for r in run_job(BODY, args=[f"s3://{bucket}/run"])])
        stored = server.keys(bucket, "run/")
        for index in range(2):  # Copies in each process's own database of step 2.
            assert any(k.startswith(f"run/2/state/ocdbt.process_{index}/d/r") for k in stored)
        for step in (0, 1):
            cp.storage.remove_tree(f"s3://{bucket}/run/{step}")
        _check_loaded(f"s3://{bucket}/run/2")
    finally:
        server.stop()
