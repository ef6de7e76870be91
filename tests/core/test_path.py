"""PathAwaitingCreation: creation is triggered once, by whoever waits first."""

from __future__ import annotations

import asyncio
import re

import pytest
from checkpointables.path import PathAwaitingCreation, as_path


def test_await_creation_creates_once(tmp_path) -> None:
    calls = []

    def create() -> None:
        calls.append(1)
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "sub").mkdir()

    root = PathAwaitingCreation(tmp_path / "d", create)
    child = root / "sub"
    assert child.path == tmp_path / "d" / "sub" and child.name == "sub"
    assert not child.path.exists()

    async def both():
        return await asyncio.gather(root.await_creation(), child.await_creation())

    assert asyncio.run(both()) == [tmp_path / "d", tmp_path / "d" / "sub"]
    assert calls == [1]
    assert root.create_now() == tmp_path / "d"
    assert calls == [1]


def test_creation_error_is_raised_to_every_waiter(tmp_path) -> None:
    def create() -> None:
        raise PermissionError("no")

    root = PathAwaitingCreation(tmp_path / "d", create)
    with pytest.raises(PermissionError):
        asyncio.run(root.await_creation())
    with pytest.raises(PermissionError):
        root.create_now()


@pytest.mark.parametrize("url", ["memory://x/y", "ftp://host/ckpt", "file:///tmp/ckpt"])
def test_a_path_no_storage_reaches_is_a_library_error(tmp_path, url) -> None:
    import checkpointables as cp

    calls = [
        lambda: cp.save_checkpointables(url, {"config": {"a": 1}}),
        lambda: cp.load_checkpointables(url),
        lambda: cp.pytree_metadata(url),
        lambda: cp.is_checkpoint(url),
        lambda: cp.partial.save(url, {"a": 1}),
        lambda: cp.training.Checkpointer(url),
    ]
    for call in calls:
        with pytest.raises(cp.errors.UnsupportedPathError, match=url.split("://")[0] + "://"):
            call()
    assert isinstance(cp.errors.UnsupportedPathError("x"), ValueError)
    assert cp.path.as_path(tmp_path) == cp.path.Path(tmp_path)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("s3:///x", "names no bucket: s3:// paths have the form s3://BUCKET/KEY"),
        ("s3://", "names no bucket"),
        ("gs:///ckpt/1", "names no bucket: gs:// paths have the form gs://BUCKET/KEY"),
        ("s3://ab/x", "'ab' is not an S3 bucket name"),
        ("s3://-runs/x", "'-runs' is not an S3 bucket name"),
        ("s3://my..runs/x", "'my..runs' is not an S3 bucket name"),
        ("s3://192.168.0.1/x", "'192.168.0.1' is not an S3 bucket name"),
    ],
)
def test_an_object_store_url_without_a_valid_bucket_is_refused_before_any_request(
    url, says, capsys
) -> None:
    # Refused as the path is read, before any request (epath alone would take s3:///x for
    # the bucket x, which TensorStore refuses with a bare ValueError, as every bad name).
    import checkpointables as cp
    from checkpointables import cli

    calls = [
        lambda: cp.load_pytree(url),
        lambda: cp.is_checkpoint(url),
        lambda: cp.save_pytree(url, {"a": 1}),
        lambda: cp.checkpointables_metadata(url),
        lambda: cp.training.Checkpointer(url),
        lambda: cp.storage.list_files(url),  # A string given to storage directly.
        lambda: cp.storage.exists(url),
    ]
    for call in calls:
        with pytest.raises(cp.errors.InvalidArgumentError, match=re.escape(says)) as caught:
            call()
        assert repr(url) in str(caught.value)
    assert cli.main(["inspect", url]) == 2
    assert says in capsys.readouterr().err


def test_bucket_names_that_tensorstore_and_s3_compatible_servers_take_pass() -> None:
    # Old us-east-1 names (capitals, '_') are refused by AWS for new buckets, not by
    # TensorStore or every S3-compatible server: the request says whether the bucket exists.
    for url in ("s3://my-checkpoints/run/1", "s3://Old_Bucket/x", "gs://bucket/x", "s3://abc"):
        assert str(as_path(url)) == url
