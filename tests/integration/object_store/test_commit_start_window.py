"""On an object store a save clears its prefix as it starts (an overwrite's old checkpoint, a
dead save's leftovers): it deletes only what its start's check listed. Objects a user put
there after that check and before the clearing (at the top, or inside the old checkpoint's
folders) are never deleted: the save refuses, naming them, and writes and removes nothing.
The check costs no request: the start's listing (every key) is kept."""

from __future__ import annotations

import checkpointables as cp
import numpy as np
import pytest

from ...core.helpers import SaveOnlyHandler
from ...object_store_server import S3Proxy

OLD = {"w": np.arange(4.0)}


class Intrusion:
    """A checkpointable whose save puts ``objects`` under ``prefix`` (as a user would) after
    the save's start check and before the save claims and clears the prefix."""

    def __init__(self, prefix: str, objects: dict[str, bytes], endpoint: str) -> None:
        self.prefix = prefix
        self.objects = objects
        self.endpoint = endpoint  # The server's: not through the save's (counting) proxy.


class IntrudingHandler(SaveOnlyHandler):
    """Writes the ``Intrusion``'s objects in its blocking phase, then awaits the save's
    directory (its creation claims and clears the prefix)."""

    handles = Intrusion

    async def save(self, directory, checkpointable):
        direct = cp.options.StorageOptions(endpoint=checkpointable.endpoint)
        with cp.Context(storage_options=direct):
            for key, data in checkpointable.objects.items():
                cp.storage.write_bytes(f"{checkpointable.prefix}/{key}", data)
        await directory.await_creation()
        return None


@pytest.fixture
def intruding():
    cp.handlers.register_handler(IntrudingHandler, priority=5)
    yield
    cp.handlers.unregister_handler(IntrudingHandler)


def _objects(prefix: str) -> dict[str, bytes]:
    return {f: cp.storage.read_bytes(f"{prefix}/{f}") for f in cp.storage.list_files(prefix)}


@pytest.mark.parametrize("overwrite", [True, False], ids=["an overwrite", "a new save"])
@pytest.mark.parametrize(
    ("put", "shown"),
    [
        ({"mine.txt": b"mine"}, "mine.txt"),
        ({"results/a.csv": b"1\n"}, "results/a.csv"),
        ({"pytree/notes.txt": b"n"}, "pytree/notes.txt"),  # In the old checkpoint's folder.
    ],
    ids=["an object", "a folder", "inside a checkpointable's folder"],
)
def test_objects_put_after_the_start_check_are_not_deleted(
    s3, bucket, intruding, overwrite, put, shown
) -> None:
    path = f"{bucket}/ck"
    if overwrite:
        cp.save_pytree(path, OLD)
    before = _objects(path)
    items = {"intruder": Intrusion(path, put, s3.endpoint), "pytree": {"v": np.ones(3)}}
    proxy = S3Proxy(s3.endpoint)
    try:
        through = cp.options.StorageOptions(endpoint=proxy.endpoint)
        with (
            cp.Context(storage_options=through),
            proxy.counting() as counts,
            pytest.raises(cp.errors.CheckpointExistsError) as refused,
        ):
            cp.save_checkpointables(path, items, overwrite=overwrite)
    finally:
        proxy.stop()
    message = str(refused.value)
    assert f"{path} changed after this save checked it ({shown} appeared there" in message
    assert "Nothing was written or removed" in message, message
    assert _objects(path) == {**before, **put}  # The old checkpoint whole, the user's kept.
    assert counts.requests["PUT"] == 0 and counts.requests["DELETE"] == 0, counts.requests
    if overwrite:
        np.testing.assert_array_equal(cp.load_pytree(path)["w"], OLD["w"])
    else:
        assert not cp.is_checkpoint(path)


def test_an_overwrite_still_deletes_what_its_start_check_saw(s3, bucket) -> None:
    path = f"{bucket}/ck"
    cp.save_checkpointables(path, {"old": {"a": 1}, "pytree": OLD})
    cp.save_checkpointables(path, {"pytree": {"v": np.ones(2)}}, overwrite=True)
    assert not [f for f in cp.storage.list_files(path) if f.startswith("old/")]
    assert set(cp.load_checkpointables(path)) == {"pytree"}
