"""Fixtures for the object-store tests: moto's S3 server on 127.0.0.1, reached over HTTP.

The library finds the server through the standard AWS environment variables,
as it would find a real bucket; every test gets a fresh bucket.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ...object_store_server import S3Server, aws_environment

# Settings of the developer's machine must not leak into the tests.
_CLEARED = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_REGION",
    "AWS_ENDPOINT_URL_S3",
    "AWS_SESSION_TOKEN",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One S3-compatible server for the whole session."""
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The server, with the standard AWS variables pointing at it."""
    for name in _CLEARED:
        monkeypatch.delenv(name, raising=False)
    for name, value in aws_environment(s3_server.endpoint).items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture
def bucket(s3: S3Server) -> str:
    """A fresh, empty bucket, as ``s3://<name>``."""
    return f"s3://{s3.new_bucket()}"
