"""Small files on an object store are read only up to their bound (``cp.storage.BoundedReads``).

A checkpoint's metadata, ``_CHECKSUMS`` and the other small files are read
with a bound (``max_bytes``); on S3 an object larger than the bound is
refused after one ranged GET of a single byte, not after downloading it
whole. Measured at the server (a counting proxy: bytes received) and as the
peak RSS of a process that loads such a checkpoint.
"""

from __future__ import annotations

import boto3
import checkpointables as cp
import numpy as np
import pytest

from ...object_store_server import S3Proxy, _client_args
from ...peak_rss import run_child

BIG = 64 << 20
BOUND = 1 << 20  # The files' bound in these tests (the library's is 256 MiB).


@pytest.fixture
def proxy(s3):
    proxy = S3Proxy(s3.endpoint)
    yield proxy
    proxy.stop()


def _put(s3, url: str, data: bytes) -> None:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    boto3.client("s3", **_client_args(s3.endpoint)).put_object(Bucket=bucket, Key=key, Body=data)


def test_an_object_over_the_bound_is_refused_after_one_byte(s3, bucket, proxy) -> None:
    url = f"{bucket}/big"
    _put(s3, url, b"x" * (4 * BOUND))
    with cp.Context(storage_options=cp.options.StorageOptions(endpoint=proxy.endpoint)):
        with proxy.counting() as counts, pytest.raises(cp.errors.MetadataError, match=url):
            cp.storage.read_bytes(url, max_bytes=BOUND)
        assert counts.requests == {"GET": 1}, counts
        assert sum(counts.bytes_received.values()) < 4096, counts  # One byte and headers.
        _put(s3, url, b"x" * BOUND)  # At the bound: read, in two GETs.
        with proxy.counting() as counts:
            assert cp.storage.read_bytes(url, max_bytes=BOUND) == b"x" * BOUND
        assert counts.requests == {"GET": 2}, counts
        with proxy.counting() as counts, pytest.raises(FileNotFoundError):
            cp.storage.read_bytes(f"{bucket}/none", max_bytes=BOUND)
        assert counts.requests == {"GET": 1}, counts


def test_a_load_refuses_oversized_metadata_after_one_byte(s3, bucket, proxy, monkeypatch) -> None:
    path = f"{bucket}/ckpt"
    cp.save_pytree(path, {"a": np.arange(4.0)})
    _put(s3, f"{path}/_CHECKPOINT_METADATA", b"{" * (4 * BOUND))
    monkeypatch.setattr(cp.metadata_checksums, "MAX_FILE_BYTES", BOUND)
    options = cp.options.StorageOptions(endpoint=proxy.endpoint)
    with (
        cp.Context(storage_options=options),
        proxy.counting() as counts,
        pytest.raises(cp.errors.MetadataError) as raised,
    ):
        cp.load_pytree(path)
    assert f"{path}/_CHECKPOINT_METADATA holds more than" in str(raised.value)
    assert sum(counts.bytes_received.values()) < 64 << 10, counts


CHILD = """
import checkpointables as cp
path = sys.argv[1]
cp.metadata_checksums.MAX_FILE_BYTES = int(sys.argv[2])
def load():
    try:
        cp.load_pytree(path)
    except cp.errors.MetadataError as e:
        return str(e)
    return "loaded"
cp.storage.exists(path)  # The plugins and the store opened before measuring.
message, growth = measured(load, 0)
print(json.dumps({"message": message, "growth": growth}))
"""


@pytest.mark.slow  # A child process (its imports: seconds).
def test_a_load_of_oversized_metadata_costs_no_memory(s3, bucket) -> None:
    path = f"{bucket}/ckpt"
    cp.save_pytree(path, {"a": np.arange(4.0)})
    _put(s3, f"{path}/_CHECKPOINT_METADATA", b"{" * BIG)
    report = run_child(CHILD, path, str(BOUND), devices=1)
    assert f"{path}/_CHECKPOINT_METADATA holds more than" in report["message"], report
    assert report["growth"] < BIG // 8, report["growth"] >> 20
