"""S3 bucket names are checked before any request, by TensorStore's own rules: the library
refuses exactly the names TensorStore's ``s3`` driver refuses (with
``cp.errors.InvalidArgumentError`` naming the bucket, where TensorStore raises a bare
``ValueError``), so that a TensorStore that changes its rules is noticed here."""

from __future__ import annotations

import pytest
import tensorstore as ts
from checkpointables.path._parse import is_valid_s3_bucket

_NAMES = [
    "abc",
    "my-checkpoints",
    "a.b-c.123",
    "0ab",
    "Bad_Bucket",
    "a_-b",
    "x" * 63,
    "A" * 255,
    "1.2.3.4.5",
    "xN--abc",
    "ab",
    "a" * 256,
    "-abc",
    "abc-",
    "_abc",
    "a..b",
    "a.-b",
    "a_.b",
    "192.168.0.1",
    "999.999.999.999",
    "xn--abc",
    "abc-s3alias",
    "abc--ol-s3",
    "abc def",
    "a+b",
    "a\u00e9b",
]


def _tensorstore_accepts(bucket: str, endpoint: str | None) -> bool:
    spec = {
        "driver": "s3",
        "bucket": bucket,
        "aws_region": "us-east-1",
        "aws_credentials": {"type": "anonymous"},
    }
    if endpoint is not None:
        spec["endpoint"] = endpoint
    try:
        ts.KvStore.open(spec)  # The spec is checked at once; no request is awaited.
    except ValueError as e:
        assert "Invalid S3 bucket name" in str(e), e
        return False
    return True


@pytest.mark.parametrize("bucket", _NAMES)
def test_bucket_names_are_refused_as_tensorstore_refuses_them(bucket) -> None:
    for endpoint in ("http://127.0.0.1:1", None):  # An S3-compatible server's, or AWS.
        assert is_valid_s3_bucket(bucket) == _tensorstore_accepts(bucket, endpoint), endpoint
