"""An incremental save on the S3 test server holds a few bounded pieces of a large array.

Reuse puts each array in data files of its own (the next save copies them on the
server), and a chunk never spans two files: an array of one large chunk is one
large file. Such a file is uploaded in parts of bounded size, copied from the
array as they are sent, not joined into one copy that TensorStore copies again
(which held twice the largest array on every save). The save's reported peak
staging memory is what its writes held at once.
"""

from __future__ import annotations

import logging

import checkpointables as cp
import numpy as np
import pytest

from ...object_store_server import S3Proxy, aws_environment
from .helpers import assert_equal

pytestmark = pytest.mark.fast_path  # Reuse is the fast path's.

MiB = 1 << 20
# Three parts of 8 MiB: two being sent, the next copied (storage.UPLOAD_HELD_BYTES).
BOUND = 24 * MiB


def test_a_reusing_save_uploads_a_large_array_in_bounded_parts(bucket) -> None:
    rng = np.random.default_rng(0)
    big = rng.standard_normal(28 * MiB // 4, np.float32).reshape(1024, -1)  # One 28 MiB chunk.
    tree = {"big": big, "small": np.arange(1000.0)}
    with cp.training.Checkpointer(f"{bucket}/run") as checkpointer:  # Reuse: on by default.
        checkpointer.save_pytree(0, tree)
        first = checkpointer.last_save_stats
        tree["small"] = tree["small"] + 1
        checkpointer.save_pytree(1, tree)  # The large array, unchanged, is copied on the server.
        second = checkpointer.last_save_stats
    assert 0 < first.peak_staging_bytes <= BOUND < big.nbytes
    assert second.bytes_reused == big.nbytes
    assert second.peak_staging_bytes <= BOUND
    # Step 1's copy of the file uploaded in parts holds the array's bytes.
    assert_equal(cp.load_pytree(f"{bucket}/run/1"), {"big": big, "small": np.arange(1000.0) + 1})


def test_a_context_alone_configures_the_uploads_copies_and_read_backs(
    s3, bucket, monkeypatch, caplog
) -> None:
    # No AWS_* variable: the endpoint and credentials are the cp.Context's only, and reach
    # the threads that upload in parts, copy on the server and read a step back.
    for name in aws_environment(s3.endpoint):
        monkeypatch.delenv(name)
    options = cp.options.StorageOptions(
        endpoint=s3.endpoint,
        access_key_id="testing",
        secret_access_key="testing",
        region="us-east-1",
    )
    big = np.arange(5 * MiB, dtype=np.float32)  # 20 MiB: uploaded in parts.
    with (
        cp.Context(storage_options=options) as context,
        caplog.at_level(logging.WARNING),
        cp.training.Checkpointer(f"{bucket}/run", context=context) as checkpointer,
    ):
        checkpointer.save_pytree(0, {"big": big})
        checkpointer.save_pytree(1, {"big": big})  # Copied on the server.
        assert checkpointer.last_save_stats.bytes_reused == big.nbytes
        assert_equal(cp.load_pytree(f"{bucket}/run/1"), {"big": big})
    assert "reading its metadata back failed" not in caplog.text


def test_uploads_in_parts_retry_as_the_storage_options_say(s3, bucket) -> None:
    proxy = S3Proxy(s3.endpoint)
    refused = iter(range(3))  # The first part, three times: more than botocore's default.
    proxy.refuse = lambda method, path: (
        method == "PUT" and "partNumber=1&" in path + "&" and next(refused, None) is not None
    )
    options = cp.options.StorageOptions(endpoint=proxy.endpoint, request_retries=5)
    big = np.ones(17 * MiB, np.uint8)
    try:
        with cp.Context(storage_options=options) as context:
            with cp.training.Checkpointer(f"{bucket}/run", context=context) as checkpointer:
                checkpointer.save_pytree(0, {"big": big})
            assert_equal(cp.load_pytree(f"{bucket}/run/0"), {"big": big})
    finally:
        proxy.stop()
    assert next(refused, None) is None  # All three refusals were met.
