"""Saves through a network that fails and delays requests: whole or a library error, never damage.

A proxy of our own (tests/object_store_server.py) sits between the library
and the S3 server and disturbs a few percent of the requests: ``503
SlowDown`` answers, connections dropped before the server sees a request,
and answers lost after it handled one. TensorStore retries; what still
fails must surface as a ``cp.errors.CheckpointError``, and whatever got
committed must load bit for bit (read back around the proxy).
"""

from __future__ import annotations

import checkpointables as cp
import numpy as np
import pytest

from ...object_store_server import Faults, S3Proxy
from .helpers import assert_equal

pytestmark = pytest.mark.slow


def _tree(version: int) -> dict:
    rng = np.random.default_rng(version)
    return {
        "small": {f"leaf{i}": rng.random(16) for i in range(200)},
        "large": rng.random(1 << 18),  # 2 MiB, through TensorStore's zarr3 driver.
        "step": version,
    }


def _save_all(bucket: str, versions: range, options: cp.options.StorageOptions) -> dict[int, str]:
    """Saves each version through the proxy; returns how each ended."""
    outcomes = {}
    with cp.Context(storage_options=options):
        for version in versions:
            try:
                cp.save_pytree(f"{bucket}/v{version}", _tree(version))
                outcomes[version] = "saved"
            except cp.errors.CheckpointError as e:
                outcomes[version] = f"failed: {type(e).__name__}"
    return outcomes


def _check_committed(bucket: str, outcomes: dict[int, str], direct: cp.options.StorageOptions):
    with cp.Context(storage_options=direct):
        for version, outcome in outcomes.items():
            path = f"{bucket}/v{version}"
            if outcome == "saved":
                assert cp.is_checkpoint(path), path
            if cp.is_checkpoint(path):  # Also a save that failed after its commit.
                assert_equal(cp.load_pytree(path), _tree(version))


@pytest.fixture
def proxy(s3):
    proxy = S3Proxy(s3.endpoint)
    yield proxy
    proxy.stop()


def test_a_few_percent_of_failing_requests_are_retried(s3, proxy) -> None:
    # (Few 503s: TensorStore backs off a second or more before retrying each.)
    proxy.faults = Faults(fail_before=0.02, drop_before=0.03, drop_after=0.03, delay=0.05, seed=7)
    bucket = f"s3://{s3.new_bucket()}"
    through_proxy = cp.options.StorageOptions(endpoint=proxy.endpoint)
    with proxy.counting() as counts:
        outcomes = _save_all(bucket, range(3), through_proxy)
        with cp.Context(storage_options=through_proxy):
            assert_equal(cp.load_pytree(f"{bucket}/v0"), _tree(0))  # Reads are retried too.
    assert counts.faults > 0, "the proxy must have disturbed some requests"
    assert set(outcomes.values()) == {"saved"}, outcomes
    _check_committed(bucket, outcomes, cp.options.StorageOptions(endpoint=s3.endpoint))


def test_failures_beyond_the_retries_are_library_errors_and_commit_nothing_damaged(
    s3, proxy
) -> None:
    proxy.faults = Faults(fail_before=0.01, drop_before=0.12, drop_after=0.08, seed=3)
    bucket = f"s3://{s3.new_bucket()}"
    outcomes = _save_all(
        bucket, range(6), cp.options.StorageOptions(endpoint=proxy.endpoint, request_retries=1)
    )
    assert any(o.startswith("failed") for o in outcomes.values()), outcomes
    _check_committed(bucket, outcomes, cp.options.StorageOptions(endpoint=s3.endpoint))
