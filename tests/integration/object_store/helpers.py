"""Trees and planted leftovers shared by the object-store tests."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import boto3
import jax
import numpy as np

from ...object_store_server import S3Server


def tree(version: int = 0) -> dict:
    """A pytree of every kind of leaf; each value depends on ``version``."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", "y"))
    return {
        "params": {
            "w": jax.device_put(
                np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + version, sharding
            ),
            # 1 MiB: written by TensorStore's zarr3 driver, not batched with the small ones.
            "big": np.arange(1 << 18, dtype=np.float32) * (version + 1),
            "b": np.full(7, version, np.int32),
        },
        "step": 100 + version,
        "lr": 0.5 + version,
        "name": f"run-{version}",
        "blob": bytes([version % 256]) * 5,
    }


def assert_equal(loaded: dict, expected: dict) -> None:
    """Bit-for-bit equality of two trees of the shape ``tree`` returns."""
    flat_loaded, def_loaded = jax.tree_util.tree_flatten(loaded)
    flat_expected, def_expected = jax.tree_util.tree_flatten(expected)
    assert def_loaded == def_expected
    for got, want in zip(flat_loaded, flat_expected, strict=True):
        if isinstance(want, (np.ndarray, jax.Array)):
            got, want = np.asarray(got), np.asarray(want)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.tobytes() == want.tobytes()
        else:
            assert type(got) is type(want) and got == want


def dead_pid() -> int:
    """The id of a process that has exited."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def plant_unfinished(
    server: S3Server, url: str, *, pid: int | None, started_ns: int | None = None
) -> None:
    """Objects of a save that never committed at ``url`` (with a record unless ``pid`` is None)."""
    bucket, _, key = url.removeprefix("s3://").partition("/")
    client = boto3.client("s3", endpoint_url=server.endpoint)
    client.put_object(Bucket=bucket, Key=f"{key}/pytree/d/junk", Body=b"half a save")
    client.put_object(Bucket=bucket, Key=f"{key}/orbax.checkpoint", Body=b"")
    if pid is not None:
        record = {
            "save_id": "planted",
            "started_ns": time.time_ns() if started_ns is None else started_ns,
            "pid": pid,
            "host": socket.gethostname(),
            "deleting": False,
        }
        client.put_object(
            Bucket=bucket, Key=f"{key}/.checkpointables-save", Body=json.dumps(record).encode()
        )


def keys(server: S3Server, url: str) -> list[str]:
    """The keys under ``url`` (relative to it), sorted."""
    bucket, _, key = url.removeprefix("s3://").partition("/")
    prefix = f"{key}/" if key else ""
    return [k[len(prefix) :] for k in server.keys(bucket, prefix)]
