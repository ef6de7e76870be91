"""The 2-process saves and restores of test_multiprocess_pytree, against an S3 server.

Every process writes its shards to the same s3:// prefix (its own OCDBT
database there) and the primary host merges and commits. The checkpoint is
then restored in this process (8 devices) and by 2 processes x 4 devices on
another mesh.
"""

from __future__ import annotations

import asyncio

import checkpointables as cp
import jax
import numpy as np
import pytest

from ...object_store_server import S3Server, aws_environment
from .launcher import run_job
from .test_multiprocess_pytree import RESTORE_BODY, SAVE_TREE, _assert_tree, values

pytestmark = pytest.mark.multiprocess
P = jax.sharding.PartitionSpec

SAVE_BODY = (
    SAVE_TREE
    + """
root = sys.argv[1]
tree = global_tree()
cp.save_pytree(root + "/pytree_ckpt", tree, custom_metadata={"saved_by": NUM_PROCESSES})
assert cp.load_pytree(root + "/pytree_ckpt")["host"]["run"] == "exp-7"
cp.save_checkpointables(root + "/two_items", {"state": tree, "extra": {"note": "hello"}})
policy = cp.training.preservation_policies.LatestN(2)
with cp.training.Checkpointer(root + "/run", preservation_policy=policy) as checkpointer:
    for step in range(3):
        state = {"w": tree["sharded"] + step, "r": tree["replicated"] + step}
        assert checkpointer.save_pytree(step, state, force=True)
    checkpointer.wait()
    print("STEPS", [s.step for s in checkpointer.steps()], flush=True)
"""
)


@pytest.fixture(scope="module")
def saved():
    """A bucket holding what 2 processes x 2 devices saved, with the AWS variables set."""
    server = S3Server()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in aws_environment(server.endpoint).items():
            patch.setenv(name, value)
        root = f"s3://{server.new_bucket()}/job"
        for result in run_job(SAVE_BODY, args=[root]):
            result.check()
            assert "STEPS [1, 2]" in result.stdout
        yield server, root
    server.stop()


def test_every_process_writes_its_own_database_under_the_prefix(saved) -> None:
    server, root = saved
    bucket, _, prefix = root.removeprefix("s3://").partition("/")
    stored = [k.removeprefix(prefix + "/") for k in server.keys(bucket, prefix + "/")]
    for process in (0, 1):
        assert any(k.startswith(f"pytree_ckpt/pytree/ocdbt.process_{process}/d/") for k in stored)
    assert {k.split("/")[0] for k in stored} == {"pytree_ckpt", "two_items", "run"}
    assert not any(".checkpointables-save" in k for k in stored)  # Every save finished.
    assert sorted({k.split("/")[1] for k in stored if k.startswith("run/")}) == ["1", "2"]


def test_loads_in_one_process_with_eight_devices(saved) -> None:
    _, root = saved
    path = f"{root}/pytree_ckpt"
    _assert_tree(cp.load_pytree(path))
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    abstract = cp.pytree_metadata(path).metadata
    for name in values():
        abstract[name] = jax.ShapeDtypeStruct(
            abstract[name].shape,
            abstract[name].dtype,
            sharding=jax.sharding.NamedSharding(mesh, P("a", "b")),
        )
    _assert_tree(cp.load_pytree(path, abstract))
    assert cp.pytree_metadata(path).custom_metadata == {"saved_by": 2}
    assert asyncio.run(cp.handlers.get("pytree")().verify(cp.path.Path(path) / "pytree")) == []
    loaded = cp.load_checkpointables(f"{root}/two_items")
    assert loaded["extra"] == {"note": "hello"}
    with cp.training.Checkpointer(f"{root}/run") as checkpointer:
        np.testing.assert_array_equal(
            np.asarray(checkpointer.load_pytree(2)["w"]), values()["sharded"] + 2
        )


def test_restores_on_two_processes_with_another_mesh(saved) -> None:
    _, root = saved
    results = run_job(RESTORE_BODY, devices_per_process=4, args=[f"{root}/pytree_ckpt"])
    for result in results:
        result.check()
        assert "RESTORED" in result.stdout
