"""The free functions on s3:// paths: round trips, the commit marker, overwrites, leftovers."""

from __future__ import annotations

import os

import boto3
import checkpointables as cp
import jax
import numpy as np
import pytest

from ...python_subprocess import run_python
from ...races import load_while_overwriting
from .helpers import assert_equal, dead_pid, keys, plant_unfinished, tree


def test_pytree_round_trip_sync_and_async(bucket) -> None:
    path = f"{bucket}/run/1"
    saved = tree(1)
    cp.save_pytree(path, saved, custom_metadata={"run": "exp-7"})
    assert_equal(cp.load_pytree(path), saved)
    # Onto another mesh, through the abstract tree the metadata gives.
    abstract = cp.pytree_metadata(path).metadata
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("b", "a"))
    abstract["params"]["w"] = jax.ShapeDtypeStruct((64, 32), np.float32, sharding=sharding)
    resharded = cp.load_pytree(path, abstract)
    assert resharded["params"]["w"].sharding == sharding
    assert_equal(resharded, saved)
    assert cp.pytree_metadata(path).custom_metadata == {"run": "exp-7"}

    cp.save_pytree_async(f"{bucket}/run/2", tree(2)).result()
    assert_equal(cp.load_pytree_async(f"{bucket}/run/2").result(), tree(2))


def test_checkpointables_and_their_metadata(bucket) -> None:
    path = f"{bucket}/multi"
    cp.save_checkpointables(path, {"state": tree(3), "extra": {"note": "hi", "n": [1, 2]}})
    loaded = cp.load_checkpointables(path)
    assert loaded["extra"] == {"note": "hi", "n": [1, 2]}
    assert_equal(loaded["state"], tree(3))
    meta = cp.checkpointables_metadata(path).metadata
    assert sorted(meta) == ["extra", "state"]
    assert meta["state"]["params"]["big"].shape == (1 << 18,)
    assert cp.load_pytree(path)["step"] == 103  # Finds the pytree among the checkpointables.


def test_a_checkpoint_is_committed_by_its_marker_written_last(s3, bucket) -> None:
    path = f"{bucket}/ckpt"
    cp.save_pytree(path, {"a": np.arange(3)})
    stored = keys(s3, path)
    # Orbax's layout on object stores: no temporary names, no record left behind.
    assert {"commit_success.txt", "_CHECKPOINT_METADATA", "orbax.checkpoint"} <= set(stored)
    assert {"pytree/_METADATA", "pytree/manifest.ocdbt"} <= set(stored)
    assert not any("tmp" in k or k.startswith(".") for k in stored)
    assert cp.is_checkpoint(path)
    assert not cp.is_checkpoint(bucket)  # A root of checkpoints is not one.

    plant_unfinished(s3, f"{bucket}/unfinished", pid=os.getpid())
    assert not cp.is_checkpoint(f"{bucket}/unfinished")
    with pytest.raises(cp.errors.NotACheckpointError, match="commit_success.txt"):
        cp.load_pytree(f"{bucket}/unfinished")
    with pytest.raises(FileNotFoundError, match="nothing is stored"):
        cp.load_pytree(f"{bucket}/absent")
    with pytest.raises(cp.errors.NotACheckpointError, match="directory holding checkpoints ckpt"):
        cp.load_pytree(bucket)


def test_overwrite_replaces_the_whole_checkpoint(s3, bucket) -> None:
    path = f"{bucket}/ckpt"
    cp.save_pytree(path, tree(1))
    old = set(keys(s3, path))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        cp.save_pytree(path, tree(2))
    assert_equal(cp.load_pytree(path), tree(1))  # A refused save changes nothing.
    cp.save_pytree(path, {"only": np.zeros(2)}, overwrite=True)
    assert_equal(cp.load_pytree(path), {"only": np.zeros(2)})
    new = set(keys(s3, path))
    data = lambda names: {k for k in names if "/d/" in k}  # noqa: E731
    assert not data(old) & data(new), "every object of the old checkpoint is deleted"


def test_an_abandoned_unfinished_save_is_cleaned_by_the_next_save(s3, bucket) -> None:
    path = f"{bucket}/ckpt"
    plant_unfinished(s3, path, pid=dead_pid())  # Its process is gone: provably abandoned.
    cp.save_pytree(path, {"a": np.arange(4)})
    assert "pytree/d/junk" not in keys(s3, path)
    assert_equal(cp.load_pytree(path), {"a": np.arange(4)})

    old = f"{bucket}/old"
    plant_unfinished(s3, old, pid=os.getpid(), started_ns=1)  # Older than the save timeout.
    cp.save_pytree(old, {"a": np.arange(2)})
    assert "pytree/d/junk" not in keys(s3, old)


def test_a_save_that_may_still_run_is_not_replaced_without_overwrite(s3, bucket) -> None:
    path = f"{bucket}/ckpt"
    plant_unfinished(s3, path, pid=os.getpid())  # A live process, recently: maybe running.
    with pytest.raises(FileExistsError, match=f"process {os.getpid()}"):
        cp.save_pytree(path, {"a": np.arange(3)})
    cp.save_pytree(path, {"a": np.arange(3)}, overwrite=True)
    assert_equal(cp.load_pytree(path), {"a": np.arange(3)})
    assert "pytree/d/junk" not in keys(s3, path)
    # Objects no save of ours wrote are never taken for a leftover.
    foreign = f"{bucket}/foreign"
    plant_unfinished(s3, foreign, pid=None)
    with pytest.raises(FileExistsError, match="orbax.checkpoint, pytree, which no checkpoint"):
        cp.save_pytree(foreign, {"a": np.arange(3)})


def test_loads_racing_overwrites_return_one_checkpoint_whole_or_say_it_changed(bucket) -> None:
    versions = [{"v": np.full(1000, v, np.int64), "n": v} for v in range(2)]
    outcomes = load_while_overwriting(f"{bucket}/raced", versions, 12, absent=True)
    assert "whole" in outcomes


def test_without_the_pytree_plugin_the_error_names_the_extra(bucket) -> None:
    result = run_python(
        """
        import sys
        import checkpointables as cp
        for path in (sys.argv[1], "gs://some-bucket/ckpt"):
            try:
                cp.save_checkpointables(path, {"extra": {"a": 1}})
            except cp.storage.MissingStorageError as e:
                print("ERROR", e)
        """,
        f"{bucket}/ckpt",
        CHECKPOINTABLES_DISABLE_PLUGINS="pytree",
    )
    assert result.returncode == 0, result.stderr
    assert 'pip install "checkpointables[s3]"' in result.stdout
    assert 'pip install "checkpointables[gcs]"' in result.stdout


@pytest.mark.filterwarnings("ignore::UserWarning")  # Orbax warns about our typestr, its shardings.
def test_the_layout_is_orbax_s_both_ways(s3, bucket, tmp_path) -> None:
    """Orbax cannot reach a local server, so its files travel through boto3, unchanged."""
    from orbax.checkpoint import v1 as ocp

    client = boto3.client("s3", endpoint_url=s3.endpoint)
    name = bucket.removeprefix("s3://")
    values = {"a": np.arange(5), "b": {"c": np.ones((3, 3))}}
    ocp.save(tmp_path / "orbax", values)  # Orbax writes commit_success.txt too.
    for file in (tmp_path / "orbax").rglob("*"):
        if file.is_file():
            key = f"from-orbax/{file.relative_to(tmp_path / 'orbax')}"
            client.put_object(Bucket=name, Key=key, Body=file.read_bytes())
    assert cp.is_checkpoint(f"{bucket}/from-orbax")
    assert_equal(cp.load_pytree(f"{bucket}/from-orbax"), values)

    cp.save_pytree(f"{bucket}/ours", values)
    for key in keys(s3, f"{bucket}/ours"):
        target = tmp_path / "ours" / key
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(client.get_object(Bucket=name, Key=f"ours/{key}")["Body"].read())
    assert_equal(ocp.load(tmp_path / "ours"), values)
