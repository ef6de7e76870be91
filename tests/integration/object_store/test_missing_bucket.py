"""A bucket that does not exist: every operation says so, naming the bucket and the endpoint.

Not the server's raw XML answer: "bucket X does not exist at endpoint Y", and
what to do about it. ``cp.is_checkpoint`` raises too rather than answering
``False``: a misspelt bucket or a wrong endpoint is not "no checkpoint yet".
"""

from __future__ import annotations

import uuid

import checkpointables as cp
import numpy as np
import pytest

_OPERATIONS = {
    "save": lambda p: cp.save_pytree(f"{p}/1", {"w": np.ones(3)}),
    "load": lambda p: cp.load_pytree(f"{p}/1"),
    "metadata": lambda p: cp.pytree_metadata(f"{p}/1"),
    "is_checkpoint": lambda p: cp.is_checkpoint(f"{p}/1"),
    "Checkpointer.save_pytree": lambda p: _checkpointer_save(p),
    "Checkpointer.latest_step": lambda p: cp.training.Checkpointer(p).latest_step(),
}


def _checkpointer_save(root: str) -> None:
    with cp.training.Checkpointer(root) as checkpointer:
        checkpointer.save_pytree(1, {"w": np.ones(3)}, force=True)


@pytest.mark.parametrize("operation", _OPERATIONS)
def test_a_missing_bucket_is_named_with_the_endpoint(s3, operation) -> None:
    bucket = f"missing-{uuid.uuid4().hex[:12]}"
    with pytest.raises(cp.errors.StorageError) as raised:
        _OPERATIONS[operation](f"s3://{bucket}/run")
    message = str(raised.value)
    assert f"bucket {bucket!r} does not exist at endpoint {s3.endpoint}" in message, message
    assert "create the bucket" in message.lower()
    assert "<?xml" not in message and "http_response_body" not in message
