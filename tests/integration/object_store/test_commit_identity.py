"""What a load costs to tell the checkpoint it opened from one that replaces it.

A load notes the identity of the commit it opens (``commit_success.txt``)
and checks it again at the end. Where the storage tells versions
(``cp.storage.Versions``: the object's ETag, from a HEAD) the marker is
never read; else it is read with a bound of 64 KiB, so a hostile marker of
many MiB costs neither memory nor transfer. Counted by a proxy in front of
the server.
"""

from __future__ import annotations

import boto3
import checkpointables as cp
import numpy as np
import pytest

from ...object_store_server import S3Proxy, _client_args


@pytest.fixture
def proxy(s3):
    proxy = S3Proxy(s3.endpoint)
    yield proxy
    proxy.stop()


def _versions(path: str) -> bool:
    return isinstance(cp.storage.for_path(path), cp.storage.Versions)


@pytest.mark.fast_path  # The total: the fast path reads the database in fewer requests.
def test_a_small_load_checks_its_commit_in_few_requests(s3, bucket, proxy) -> None:
    path = f"{bucket}/ckpt"
    cp.save_pytree(path, {"a": np.arange(4.0)})
    with cp.Context(storage_options=cp.options.StorageOptions(endpoint=proxy.endpoint)):
        cp.storage.exists(path)  # The store opened before counting.
        with proxy.counting() as counts:
            cp.load_pytree(path)
        versions = _versions(path)
    # Twice the marker: a HEAD each where the storage tells versions (as many requests as
    # reading it whole), else a bounded read each (a ranged GET of one byte, then the object).
    # And one ranged GET of one byte: the database's manifest is within its bound. The
    # database's _CHECKSUMS is looked for once, though the index and the metadata read both
    # want it at once (the count was 15 or 16 by the threads' timing).
    assert counts.requests["HEAD"] == (2 if versions else 0), counts
    assert counts.total == (15 if versions else 17), counts


def test_a_huge_marker_is_never_downloaded(s3, bucket, proxy) -> None:
    path = f"{bucket}/ckpt"
    cp.save_pytree(path, {"a": np.arange(4.0)})
    marker = f"{path}/{cp.layout.COMMIT_SUCCESS_FILE}"
    name, _, key = marker.removeprefix("s3://").partition("/")
    client = boto3.client("s3", **_client_args(s3.endpoint))
    client.put_object(Bucket=name, Key=key, Body=b"x" * (4 << 20))
    options = cp.options.StorageOptions(endpoint=proxy.endpoint)
    with cp.Context(storage_options=options), proxy.counting() as counts:
        if _versions(path):  # Its version is all a load needs of it.
            np.testing.assert_array_equal(cp.load_pytree(path)["a"], np.arange(4.0))
        else:
            with pytest.raises(cp.errors.IntegrityError, match="holds more than") as e:
                cp.load_pytree(path)
            assert marker in str(e.value)
    assert sum(counts.bytes_received.values()) < 64 << 10, counts
