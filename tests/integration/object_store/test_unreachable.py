"""An object store that cannot be reached (no network, no credentials, a server that never
answers): every call fails within ``StorageOptions.request_timeout_secs`` with a
``cp.errors.StorageError`` naming what to configure, where TensorStore alone would retry
for many minutes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.same_either_way  # Every call fails at its first request.

# Each call in a fresh process with no credentials of any kind: the machine running the
# tests may have some, and a call that hangs must not hang the test (two minutes at most).
_CALLS = """
import sys, time
import checkpointables as cp
import numpy as np

url, timeout = sys.argv[1], float(sys.argv[2])
cp.configure(storage_options=cp.options.StorageOptions(request_timeout_secs=timeout))
calls = {
    "is_checkpoint": lambda: cp.is_checkpoint(url),
    "load_pytree": lambda: cp.load_pytree(url),
    "checkpointables_metadata": lambda: cp.checkpointables_metadata(url),
    "save_pytree": lambda: cp.save_pytree(url, {"a": np.arange(3)}),
}
for name, call in calls.items():
    start = time.monotonic()
    try:
        call()
        outcome = "no error"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    print(f"{name}\\t{time.monotonic() - start:.1f}\\t{outcome}", flush=True)
"""
_TIMEOUT_SECS = 4


def _outcomes(url: str, tmp_path, **env: str) -> dict[str, tuple[float, str]]:
    home = tmp_path / "home"
    home.mkdir()
    kept = {
        n: v
        for n, v in os.environ.items()
        if not n.startswith(("AWS_", "GOOGLE_", "CLOUDSDK_", "GCE_"))
    }
    result = subprocess.run(
        [sys.executable, "-c", _CALLS, url, str(_TIMEOUT_SECS)],
        env={**kept, "HOME": str(home), **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split("\t", 2) for line in result.stdout.splitlines()]
    return {name: (float(took), outcome) for name, took, outcome in lines}


def _assert_fail_in_time(outcomes: dict[str, tuple[float, str]], *names: str) -> None:
    assert len(outcomes) == 4, outcomes
    for call, (took, outcome) in outcomes.items():
        assert outcome.startswith("StorageError: "), (call, outcome)
        assert all(name in outcome for name in names), (call, outcome)
        assert took < 2 * _TIMEOUT_SECS + 5, (call, took)


def test_gcs_without_credentials_or_network_fails_in_time_naming_what_to_set(tmp_path) -> None:
    outcomes = _outcomes("gs://bucket/x", tmp_path)
    _assert_fail_in_time(outcomes, "GOOGLE_APPLICATION_CREDENTIALS", "gs://bucket/x")


@pytest.fixture
def silent_server():
    """A server that accepts connections and never answers: ``http://127.0.0.1:<port>``."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


def test_an_s3_server_that_never_answers_fails_in_time(tmp_path, silent_server) -> None:
    outcomes = _outcomes(
        "s3://bucket/x",
        tmp_path,
        AWS_ENDPOINT_URL=silent_server,
        AWS_ACCESS_KEY_ID="key",
        AWS_SECRET_ACCESS_KEY="secret",
        AWS_REGION="us-east-1",
    )
    _assert_fail_in_time(outcomes, "request_timeout_secs", "s3://bucket/x")


def test_s3_without_credentials_names_what_to_set(tmp_path) -> None:
    outcomes = _outcomes("s3://bucket/x", tmp_path)
    _assert_fail_in_time(outcomes, "AWS_ACCESS_KEY_ID", "s3://bucket/x")
