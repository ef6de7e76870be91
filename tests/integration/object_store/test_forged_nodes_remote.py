"""A forged b-tree node in a checkpoint on an object store: refused before any value is read.

The nodes are read through TensorStore's kvstore there (not from local
files), by the load's index or, with the fast path off, by the check before
TensorStore's own reads.
"""

from __future__ import annotations

import shutil

import boto3
import checkpointables as cp
import checkpointables_pytree
import numpy as np
import pytest

from ...object_store_server import _client_args
from ...plugins.pytree.test_forged_nodes import FAST_PATH_OFF, TREE, _forge_step


def _upload(local, server, url: str) -> None:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = boto3.client("s3", **_client_args(server.endpoint))
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        key = f"{prefix}/{path.relative_to(local).as_posix()}"
        client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast_path", "tensorstore"])
def test_a_forged_node_on_an_object_store_is_refused(s3, bucket, tmp_path, fast_path) -> None:
    with cp.Context(array_options=cp.options.ArrayOptions(ocdbt_fast_path=True)):
        cp.save_pytree(tmp_path / "saved", TREE)  # Forged below as our writer writes nodes.
    forged = shutil.copytree(tmp_path / "saved", tmp_path / "forged")
    file = _forge_step(forged / "pytree")
    _upload(tmp_path / "saved", s3, f"{bucket}/saved")
    _upload(forged, s3, f"{bucket}/forged")
    with FAST_PATH_OFF if not fast_path else cp.Context():
        assert cp.load_pytree(f"{bucket}/saved")["step"] == 5
        np.testing.assert_array_equal(cp.load_pytree(f"{bucket}/saved")["big"], TREE["big"])
        with pytest.raises(cp.errors.IntegrityError, match=rf"{file}: the b-tree node"):
            cp.load_pytree(f"{bucket}/forged")


def test_checksums_recorded_again_on_an_object_store(s3, bucket, tmp_path) -> None:
    cp.save_pytree(tmp_path / "saved", TREE)
    _upload(tmp_path / "saved", s3, f"{bucket}/c")
    checkpointables_pytree.record_checksums_again(f"{bucket}/c")
    assert cp.load_pytree(f"{bucket}/c")["step"] == 5
    assert (
        tmp_path / "saved" / "pytree" / "_btree_checksums"
    ).read_bytes() == cp.storage.read_bytes(f"{bucket}/c/pytree/_btree_checksums")


def test_a_truncated_data_object_is_an_integrity_error(s3, bucket, tmp_path) -> None:
    # The fast path's ranged GET past the object's end: TensorStore's bare ValueError.
    cp.save_pytree(tmp_path / "saved", TREE)
    data = max((tmp_path / "saved" / "pytree" / "d").iterdir(), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    _upload(tmp_path / "saved", s3, f"{bucket}/c")
    with pytest.raises(cp.errors.IntegrityError):
        cp.load_pytree(f"{bucket}/c")
