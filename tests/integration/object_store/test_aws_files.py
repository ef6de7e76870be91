"""The AWS configuration files and variables, resolved exactly as the AWS CLI resolves them.

The files are real files in a temporary directory, named by ``AWS_CONFIG_FILE``
and ``AWS_SHARED_CREDENTIALS_FILE`` (or found in ``$HOME/.aws``), read by
botocore's loader; TensorStore's own providers read the keys. Requests go
through a proxy that records who signed each one (access key id and region),
so the tests see what TensorStore actually sent.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import checkpointables as cp
import numpy as np
import pytest
from checkpointables_pytree import storage
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ...object_store_server import S3Proxy

_AWS_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
)


@pytest.fixture
def proxy(s3) -> Iterator[S3Proxy]:
    """A proxy in front of the server that records the signers of requests."""
    proxy = S3Proxy(s3.endpoint)
    yield proxy
    proxy.stop()


@pytest.fixture
def no_aws_environment(s3, monkeypatch) -> None:
    """None of the AWS variables the server fixture set: the files must say everything."""
    for name in _AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _files(directory: Path, config: str, credentials: str) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config").write_text(config)
    (directory / "credentials").write_text(credentials)
    return directory / "config", directory / "credentials"


def _use_files(monkeypatch, config: Path, credentials: Path) -> None:
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))


def _signers(proxy: S3Proxy, path: str) -> set[str]:
    """Who signed the requests of a save and a load of ``path`` (anonymous requests left out:
    TensorStore may ask a bucket's region unsigned)."""
    with proxy.counting() as counts:
        cp.save_pytree(path, {"a": np.arange(5)})
        assert cp.load_pytree(path)["a"].tolist() == list(range(5))
    return set(counts.signers) - {"anonymous"}


_KEYS = "aws_access_key_id = {0}\naws_secret_access_key = secret-{0}\n"


def test_a_profile_gives_region_endpoint_and_keys(
    proxy, bucket, no_aws_environment, monkeypatch, tmp_path
) -> None:
    config, credentials = _files(
        tmp_path,
        f"[profile ckpt]\nregion = eu-west-2\nservices = local\n\n"
        f"[services local]\ns3 =\n  endpoint_url = {proxy.endpoint}\n",
        f"[ckpt]\n{_KEYS.format('PROFILEKEY')}",
    )
    _use_files(monkeypatch, config, credentials)
    monkeypatch.setenv("AWS_PROFILE", "ckpt")
    assert _signers(proxy, f"{bucket}/ckpt") == {"PROFILEKEY eu-west-2"}


def test_the_default_profile_serves_without_aws_profile(
    proxy, bucket, no_aws_environment, monkeypatch, tmp_path
) -> None:
    """As ``aws configure`` leaves a machine: ``[default]`` in both files, nothing set."""
    home = tmp_path / "home"
    _files(
        home / ".aws",
        f"[default]\nregion = ap-south-1\nendpoint_url = {proxy.endpoint}\n",
        f"[default]\n{_KEYS.format('DEFAULTKEY')}",
    )
    monkeypatch.setenv("HOME", str(home))  # ~/.aws, found without AWS_CONFIG_FILE.
    assert _signers(proxy, f"{bucket}/ckpt") == {"DEFAULTKEY ap-south-1"}


def test_the_environment_keys_beat_aws_profile_and_an_option_beats_both(
    proxy, bucket, no_aws_environment, monkeypatch, tmp_path
) -> None:
    config, credentials = _files(
        tmp_path,
        f"[profile ckpt]\nregion = eu-west-2\nendpoint_url = {proxy.endpoint}\n\n"
        f"[profile other]\nregion = us-west-1\n",
        f"[ckpt]\n{_KEYS.format('PROFILEKEY')}\n[other]\n{_KEYS.format('OTHERKEY')}",
    )
    _use_files(monkeypatch, config, credentials)
    monkeypatch.setenv("AWS_PROFILE", "ckpt")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "ENVKEY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    # The profile still gives the region and the endpoint, as for the AWS CLI.
    assert _signers(proxy, f"{bucket}/env") == {"ENVKEY eu-west-2"}
    monkeypatch.setenv("AWS_REGION", "ca-central-1")
    assert _signers(proxy, f"{bucket}/region") == {"ENVKEY ca-central-1"}
    options = cp.options.StorageOptions(profile="other", endpoint=proxy.endpoint)
    with cp.Context(storage_options=options):
        assert _signers(proxy, f"{bucket}/option") == {"OTHERKEY ca-central-1"}
    options = cp.options.StorageOptions(access_key_id="OPTIONKEY", secret_access_key="s")
    with cp.Context(storage_options=options):
        assert _signers(proxy, f"{bucket}/keys") == {"OPTIONKEY ca-central-1"}


def test_aws_default_profile_comes_before_aws_profile(
    no_aws_environment, monkeypatch, tmp_path
) -> None:
    """botocore's order (the AWS CLI's loader): ``AWS_DEFAULT_PROFILE``, then ``AWS_PROFILE``."""
    config, credentials = _files(
        tmp_path, "[profile a]\nregion = eu-west-1\n[profile b]\nregion = eu-west-3\n", ""
    )
    _use_files(monkeypatch, config, credentials)
    monkeypatch.setenv("AWS_PROFILE", "a")
    monkeypatch.setenv("AWS_DEFAULT_PROFILE", "b")
    settings = storage.s3_settings(cp.options.StorageOptions())
    assert settings.region == "eu-west-3" and settings.credentials["profile"] == "b"


def test_configured_endpoints_can_be_ignored_in_the_config_file(
    no_aws_environment, monkeypatch, tmp_path
) -> None:
    config, credentials = _files(
        tmp_path,
        "[default]\nignore_configured_endpoint_urls = true\nendpoint_url = http://127.0.0.1:9\n",
        "",
    )
    _use_files(monkeypatch, config, credentials)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    assert storage.s3_settings(cp.options.StorageOptions()).endpoint is None
    options = cp.options.StorageOptions(endpoint="http://127.0.0.1:10")  # Never ignored.
    assert storage.s3_settings(options).endpoint == "http://127.0.0.1:10"


def test_a_profile_or_services_section_that_does_not_exist_is_a_clear_error(
    bucket, no_aws_environment, monkeypatch, tmp_path
) -> None:
    config, credentials = _files(tmp_path, "[profile ckpt]\nregion = eu-west-2\n", "")
    _use_files(monkeypatch, config, credentials)
    monkeypatch.setenv("AWS_PROFILE", "cktp")
    missing = rf"{config}.*profile \(cktp\) could not be found.*AWS_PROFILE"
    with pytest.raises(cp.errors.StorageError, match=missing):
        cp.save_pytree(f"{bucket}/ckpt", {"a": 1})
    config.write_text("[profile ckpt]\nservices = locl\n")
    monkeypatch.setenv("AWS_PROFILE", "ckpt")
    with pytest.raises(cp.errors.StorageError, match=r"services section 'locl' does not exist"):
        cp.save_pytree(f"{bucket}/ckpt", {"a": 1})


def test_without_botocore_the_environment_still_works(
    proxy, bucket, no_aws_environment, monkeypatch, tmp_path
) -> None:
    """Without the ``s3`` extra's botocore: variables and profiles' keys, but no regions or
    endpoints from the config file (a warning says so)."""
    monkeypatch.setitem(sys.modules, "botocore", None)  # As if it were not installed.
    config, credentials = _files(tmp_path, "[default]\nregion = eu-west-2\n", "")
    (tmp_path / "credentials").write_text(f"[default]\n{_KEYS.format('DEFAULTKEY')}")
    _use_files(monkeypatch, config, credentials)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "sa-east-1")
    with pytest.warns(RuntimeWarning, match="botocore is not installed"):
        assert _signers(proxy, f"{bucket}/ckpt") == {"DEFAULTKEY sa-east-1"}


# -- The order of precedence, for every combination of sources --------------------------------

_ENDPOINTS = {  # Highest precedence first.
    "option": "http://option:1",
    "AWS_ENDPOINT_URL_S3": "http://env-s3:1",
    "AWS_ENDPOINT_URL": "http://env:1",
    "services": "http://services:1",
    "profile": "http://profile:1",
}
_REGIONS = {
    "option": "option-1",
    "AWS_REGION": "env-1",
    "AWS_DEFAULT_REGION": "env-default-1",
    "profile": "profile-1",
}
_CREDENTIALS = ("anonymous", "keys", "option profile", "environment", "AWS_PROFILE", "default")


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Exactly ``values`` as the AWS variables, restored afterwards."""
    saved = {k: os.environ.pop(k) for k in _AWS_VARIABLES if k in os.environ}
    os.environ.update(values)
    try:
        yield
    finally:
        for k in _AWS_VARIABLES:
            os.environ.pop(k, None)
        os.environ.update(saved)


def _configuration(
    endpoints: set[str], regions: set[str], credentials: set[str], directory: Path
) -> tuple[cp.options.StorageOptions, dict[str, str]]:
    """The options, variables and files holding the chosen sources. The profiles ``ckpt``
    (named by ``AWS_PROFILE``) and ``mine`` (named by the options) say the same."""
    lines = [f"region = {_REGIONS['profile']}"] * ("profile" in regions)
    lines += [f"endpoint_url = {_ENDPOINTS['profile']}"] * ("profile" in endpoints)
    lines += ["services = here"] * ("services" in endpoints)
    profile = "\n".join(lines)
    config, creds = _files(
        directory,
        f"[profile ckpt]\n{profile}\n[profile mine]\n{profile}\n"
        f"[services here]\ns3 =\n  endpoint_url = {_ENDPOINTS['services']}\n",
        f"[ckpt]\n{_KEYS.format('CKPT')}[mine]\n{_KEYS.format('MINE')}"
        + f"[default]\n{_KEYS.format('DEFAULT')}" * ("default" in credentials),
    )
    env = {"AWS_CONFIG_FILE": str(config), "AWS_SHARED_CREDENTIALS_FILE": str(creds)}
    env |= {k: v for k, v in {**_ENDPOINTS, **_REGIONS}.items() if k in endpoints | regions}
    env.pop("option", None)
    env.pop("profile", None)
    env.pop("services", None)
    if "environment" in credentials:
        env |= {"AWS_ACCESS_KEY_ID": "ENVKEY", "AWS_SECRET_ACCESS_KEY": "s"}
    if "AWS_PROFILE" in credentials or (endpoints | regions) & {"profile", "services"}:
        env["AWS_PROFILE"] = "ckpt"
    keys = {"access_key_id": "KEY", "secret_access_key": "s"} if "keys" in credentials else {}
    options = cp.options.StorageOptions(
        endpoint=_ENDPOINTS["option"] if "option" in endpoints else None,
        region=_REGIONS["option"] if "option" in regions else None,
        anonymous="anonymous" in credentials,
        profile="mine" if "option profile" in credentials else None,
        **keys,
    )
    return options, env


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    endpoints=st.sets(st.sampled_from(list(_ENDPOINTS))),
    regions=st.sets(st.sampled_from(list(_REGIONS))),
    credentials=st.sets(st.sampled_from(_CREDENTIALS)),
)
def test_the_first_source_in_the_aws_cli_order_wins(endpoints, regions, credentials) -> None:
    with tempfile.TemporaryDirectory() as directory:
        options, env = _configuration(endpoints, regions, credentials, Path(directory))
        with _environment(env):
            settings = storage.s3_settings(options)
    expected_endpoint = next((v for k, v in _ENDPOINTS.items() if k in endpoints), None)
    expected_region = next((v for k, v in _REGIONS.items() if k in regions), None)
    assert (settings.endpoint, settings.region) == (expected_endpoint, expected_region)
    # Credentials: the options, the environment's keys, the named profile, the default one.
    named = {"AWS_PROFILE"} if "AWS_PROFILE" in env else set()
    chosen = next((c for c in _CREDENTIALS if c in credentials | named), None)
    kind, profile = settings.credentials["type"], settings.credentials.get("profile")
    assert (kind, profile) == {
        "anonymous": ("anonymous", None),
        "keys": ("profile", "checkpointables"),
        "option profile": ("profile", "mine"),
        "environment": ("environment", None),
        "AWS_PROFILE": ("profile", "ckpt"),
        "default": ("profile", "default"),
        None: ("imds", None),
    }[chosen]
