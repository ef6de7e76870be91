"""How S3 is configured: the standard AWS settings, overridden by cp.options.StorageOptions."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import checkpointables as cp
import numpy as np
import pytest
from checkpointables_pytree import storage

from .helpers import assert_equal


def _round_trip(path: str) -> None:
    cp.save_pytree(path, {"a": np.arange(5)})
    assert_equal(cp.load_pytree(path), {"a": np.arange(5)})


def test_the_endpoint_comes_from_aws_endpoint_url_s3_first(s3, bucket, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # Would refuse connections.
    assert storage.s3_settings().endpoint == s3.endpoint
    _round_trip(f"{bucket}/ckpt")


def test_an_option_overrides_the_environment(s3, bucket, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    options = cp.options.StorageOptions(endpoint=s3.endpoint, region="eu-west-3")
    with cp.Context(storage_options=options):
        _round_trip(f"{bucket}/ckpt")
        settings = storage.s3_settings()
    assert (settings.endpoint, settings.region) == (s3.endpoint, "eu-west-3")
    # cp.configure sets the same for every later call.
    cp.configure(storage_options=options)
    try:
        assert cp.load_pytree(f"{bucket}/ckpt")["a"].tolist() == list(range(5))
    finally:
        cp.configure(storage_options=cp.options.StorageOptions())


def test_a_profile_of_the_aws_config_files(s3, bucket, monkeypatch, tmp_path) -> None:
    config, credentials = tmp_path / "config", tmp_path / "credentials"
    config.write_text(
        f"[profile ckpt]\nregion = us-east-1\nservices = local\n\n"
        f"[services local]\ns3 =\n  endpoint_url = {s3.endpoint}\n"
    )
    credentials.write_text("[ckpt]\naws_access_key_id = from-file\naws_secret_access_key = x\n")
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_PROFILE", "ckpt")
    settings = storage.s3_settings()
    assert settings.endpoint == s3.endpoint and settings.region == "us-east-1"
    assert settings.credentials == {
        "type": "profile",
        "profile": "ckpt",
        "credentials_file": str(credentials),
        "config_file": str(config),
    }
    _round_trip(f"{bucket}/ckpt")  # TensorStore reads the keys from the credentials file.


def test_explicit_credentials_stay_private(s3, bucket, monkeypatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    options = cp.options.StorageOptions(access_key_id="key", secret_access_key="secret")
    assert "secret" not in repr(options)
    with cp.Context(storage_options=options):
        _round_trip(f"{bucket}/ckpt")
        credentials = storage.s3_settings().credentials
    file = credentials["credentials_file"]
    assert credentials["type"] == "profile" and "secret" in Path(file).read_text()
    assert stat.S_IMODE(os.stat(file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(file)).st_mode) == 0o700
    with pytest.raises(ValueError, match="both access_key_id and secret_access_key"):
        cp.options.StorageOptions(access_key_id="key")


def test_request_concurrency_and_retries(bucket) -> None:
    options = cp.options.StorageOptions(request_concurrency=1, request_retries=2)
    assert storage.context_resources(options)["s3_request_concurrency"] == {"limit": 1}
    with cp.Context(storage_options=options):
        _round_trip(f"{bucket}/ckpt")
    with pytest.raises(ValueError, match="int >= 1"):
        cp.options.StorageOptions(request_concurrency=0)


def test_without_any_configuration_only_an_instance_role_can_help(monkeypatch, tmp_path) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    assert storage.s3_settings().credentials == {"type": "imds"}
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "token"))
    assert storage.s3_settings().credentials == {"type": "default"}


def test_gcs_paths_use_tensorstore_gcs_driver() -> None:
    assert storage.kvstore_spec("gs://bucket/run/1") == {
        "driver": "gcs",
        "bucket": "bucket",
        "path": "run/1/",
    }
    options = cp.options.StorageOptions(request_concurrency=8)
    assert storage.context_resources(options)["gcs_request_concurrency"] == {"limit": 8}
    with pytest.raises(ValueError, match="names no bucket"):
        storage.kvstore_spec("s3://")


@pytest.mark.parametrize("path", ["q/../r5", "../r5"])
def test_dot_segments_in_an_object_store_path_are_refused(s3, bucket, path) -> None:
    # GET and PUT resolved them, LIST did not: a save replaced r5 without overwrite=True,
    # recorded no checksums, and neither path loaded afterwards.
    cp.save_pytree(f"{bucket}/r5", {"w": np.arange(3.0)})
    with pytest.raises(cp.errors.InvalidArgumentError, match="holds '.' or '..'"):
        cp.save_pytree(f"{bucket}/{path}", {"w": np.arange(5.0)})
    with pytest.raises(cp.errors.InvalidArgumentError, match="holds '.' or '..'"):
        cp.load_pytree(f"{bucket}/{path}")
    assert_equal(cp.load_pytree(f"{bucket}/r5"), {"w": np.arange(3.0)})
