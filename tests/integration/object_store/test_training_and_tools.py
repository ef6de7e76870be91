"""The Checkpointer, partial saves and the command line on s3:// paths."""

from __future__ import annotations

import json
import logging
import threading

import boto3
import checkpointables as cp
import numpy as np
import pytest
from checkpointables import cli

from ...object_store_server import S3Proxy
from ...python_subprocess import run_python
from .helpers import assert_equal, dead_pid, keys, plant_unfinished, tree


def state(step: int) -> dict:
    """The training state of ``step``."""
    return {"w": np.full((8, 8), step, np.float32), "step": step}


def test_checkpointer_lists_keeps_deletes_and_resumes_in_a_new_process(s3, bucket) -> None:
    root = f"{bucket}/run"
    keep = cp.training.preservation_policies.LatestN(2)
    with cp.training.Checkpointer(root, preservation_policy=keep, custom_metadata={"lr": 3}) as c:
        for step in range(5):
            assert c.save_pytree(step, state(step), force=True, metrics={"loss": 1 / (step + 1)})
        c.wait()
        assert [s.step for s in c.steps()] == [3, 4]
        assert c.latest_step().metrics == {"loss": 0.2}
    # The deleted steps are gone from the bucket, object by object.
    assert sorted({k.split("/")[0] for k in keys(s3, root)}) == ["3", "4", "metadata"]

    result = run_python(
        """
        import sys
        import checkpointables as cp
        with cp.training.Checkpointer(sys.argv[1]) as c:
            latest = c.latest_step()
            restored = c.load_pytree()
            print("RESUMED", latest.step, restored["step"], c.root_metadata().custom_metadata)
        """,
        root,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RESUMED 4 4 {'lr': 3}" in result.stdout


def test_checkpointer_ignores_and_cleans_unfinished_steps(s3, bucket) -> None:
    root = f"{bucket}/run"
    with cp.training.Checkpointer(root) as c:
        c.save_pytree(1, state(1), force=True)
    plant_unfinished(s3, f"{root}/2", pid=dead_pid())  # A save killed mid-way.
    plant_unfinished(s3, f"{root}/3", pid=None)  # Not ours: left alone.
    with cp.training.Checkpointer(root) as c:
        assert [s.step for s in c.steps()] == [1]
        c.wait()  # The cleanup runs in the background.
        assert not keys(s3, f"{root}/2")
        assert keys(s3, f"{root}/3")
        with pytest.raises(cp.training.errors.StepNotFoundError):
            c.load_pytree(3)
        # Saving a step where a save was interrupted replaces the leftover.
        plant_unfinished(s3, f"{root}/4", pid=None)
        assert c.save_pytree(4, state(4), force=True)
        assert_equal(c.load_pytree(4), state(4))
        assert "pytree/d/junk" not in keys(s3, f"{root}/4")


def test_partial_saves_then_finalize(s3, bucket) -> None:
    path = f"{bucket}/assembled"
    cp.partial.save(path, {"params": {"layer0": np.arange(3)}})
    cp.partial.save(path, {"params": {"layer1": np.arange(4.0)}}, custom_metadata={"by": "parts"})
    assert not cp.is_checkpoint(path)  # Nothing counts before finalize.
    # A partial save that was interrupted is dropped by finalize.
    plant_unfinished(s3, f"{path}/pytree/partial-000099", pid=dead_pid())
    cp.partial.finalize(path)
    loaded = cp.load_pytree(path)
    assert_equal(loaded, {"params": {"layer0": np.arange(3), "layer1": np.arange(4.0)}})
    assert cp.pytree_metadata(path).custom_metadata == {"by": "parts"}
    assert not any(k.startswith("pytree/partial-000099") for k in keys(s3, path))
    with pytest.raises(FileExistsError, match="finished checkpoint"):
        cp.partial.save(path, {"more": 1})
    piece = f"{path}/pytree/partial-000001"  # Told by the finished checkpoint above it.
    assert not cp.is_checkpoint(piece)
    with pytest.raises(cp.errors.NotACheckpointError, match="piece of a partial save"):
        cp.load_pytree(piece)
    # A checkpoint a user saved under such a name, with no checkpoint above it, is one.
    own = f"{bucket}/sweeps/pytree/partial-3"
    cp.save_pytree(own, {"a": np.arange(4)})
    assert cp.is_checkpoint(own)
    assert_equal(cp.load_pytree(own), {"a": np.arange(4)})


def test_finalize_never_drops_a_partial_save_still_running(s3, bucket) -> None:
    import subprocess
    import sys

    path = f"{bucket}/assembled"
    cp.partial.save(path, {"params": {"layer0": np.arange(3)}})
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:  # A save of that (live) process, not committed yet.
        plant_unfinished(s3, f"{path}/pytree/partial-000099", pid=writer.pid)
        with pytest.raises(cp.errors.CheckpointExistsError, match="still writing"):
            cp.partial.finalize(path)
        assert "pytree/partial-000099/pytree/d/junk" in keys(s3, path)
    finally:
        writer.kill()
        writer.wait(30)
    cp.partial.finalize(path)  # Its process is gone: the save never happened.
    assert_equal(cp.load_pytree(path), {"params": {"layer0": np.arange(3)}})
    assert not any(k.startswith("pytree/partial-000099") for k in keys(s3, path))


def test_inspect_and_verify(s3, bucket, capsys) -> None:
    path = f"{bucket}/ckpt"
    cp.save_pytree(path, tree(5))
    assert cli.main(["inspect", path]) == 0
    assert "['params']['big']" in capsys.readouterr().out
    assert cli.main(["verify", path]) == 0
    assert "all checks passed" in capsys.readouterr().out
    # Damage a data object: verify names the failure and exits 1.
    name, _, key = path.removeprefix("s3://").partition("/")
    client = boto3.client("s3", endpoint_url=s3.endpoint)
    data = [k for k in keys(s3, path) if k.startswith("pytree/d/")]
    for item in data:
        body = bytearray(client.get_object(Bucket=name, Key=f"{key}/{item}")["Body"].read())
        body[len(body) // 2] ^= 0xFF
        client.put_object(Bucket=name, Key=f"{key}/{item}", Body=bytes(body))
    assert cli.main(["verify", path]) == 1
    assert "FAILED" in capsys.readouterr().out
    assert cli.main(["inspect", f"{bucket}/absent"]) == 2
    assert "nothing is stored" in capsys.readouterr().err


def test_json_and_custom_leaf_files_reach_the_bucket(s3, bucket) -> None:
    path = f"{bucket}/ckpt"
    cp.save_checkpointables(path, {"pytree": {"a": np.arange(2)}, "config": {"depth": 4}})
    name, _, key = path.removeprefix("s3://").partition("/")
    body = boto3.client("s3", endpoint_url=s3.endpoint).get_object(
        Bucket=name, Key=f"{key}/config/data.json"
    )["Body"]
    assert json.loads(body.read()) == {"depth": 4}


def test_grain_iterators_and_protocol_buffers_on_s3(bucket) -> None:
    from ...plugins.grain.pipelines import map_pipeline
    from ...plugins.proto.messages import train_config

    iterator = iter(map_pipeline())
    for _ in range(5):
        next(iterator)
    config = train_config()
    path = f"{bucket}/everything"
    cp.save_checkpointables(path, {"pytree": state(5), "dataset": iterator, "config": config})
    expected = [next(iterator) for _ in range(8)]
    fresh = iter(map_pipeline())
    loaded = cp.load_checkpointables(path, {"pytree": None, "dataset": fresh, "config": None})
    assert loaded["config"] == config
    assert_equal(loaded["pytree"], state(5))
    assert [next(fresh) for _ in range(8)] == expected  # Resumed where it was saved.


def test_a_committed_step_whose_metadata_read_back_fails_is_listed_and_kept_by_policy(
    s3, bucket, caplog
) -> None:
    proxy = S3Proxy(s3.endpoint)
    committed = threading.Event()

    def refuse(method: str, path: str) -> bool:  # Step 1's metadata, once it is committed.
        if method == "PUT" and path.startswith(f"/{bucket[5:]}/run/1/commit_success.txt"):
            committed.set()
        return committed.is_set() and method == "GET" and "/run/1/_CHECKPOINT_METADATA" in path

    proxy.refuse = refuse
    options = cp.options.StorageOptions(endpoint=proxy.endpoint, request_retries=1)
    keep = cp.training.preservation_policies.LatestN(1)
    try:
        with (
            cp.Context(storage_options=options),
            caplog.at_level(logging.WARNING),
            cp.training.Checkpointer(f"{bucket}/run", preservation_policy=keep) as c,
        ):
            c.save_pytree(0, state(0), force=True)
            assert c.save_pytree(1, state(1), force=True, metrics={"loss": 1.0})
            c.wait()  # The read-back failed: not the save's error.
            assert [s.step for s in c.steps()] == [1]  # Listed; step 0 to the policy.
            assert c.latest_step().metrics == {"loss": 1.0}
            proxy.refuse = lambda method, path: False
            c.save_pytree(2, state(2), force=True)
            c.wait()
            assert [s.step for s in c.steps()] == [2]  # Step 1 to the policy in turn.
    finally:
        proxy.stop()
    assert committed.is_set()
    assert "Step 1 was committed" in caplog.text
    assert sorted({k.split("/")[0] for k in keys(s3, f"{bucket}/run")}) == ["2"]
