"""On an object store a save writes in place: objects put under its prefix while it writes
(a user's, another writer's) stop its commit, as on a local disk, and are never deleted;
the save's own objects are removed. A save that met nothing new commits, at one request
(a LIST, in the round trip of the commit's read-back) more than before."""

from __future__ import annotations

import threading

import checkpointables as cp
import numpy as np
import pytest

from ...object_store_server import S3Proxy

OLD = {"w": np.arange(4.0)}
NEW = {"v": np.ones(3), "step": 7}


class GatingProxy(S3Proxy):
    """Holds the first PUT of a key ending in ``gate_at`` until ``release`` is set (and sets
    ``arrived`` when it comes): the save is then past its start, writing its metadata."""

    def __init__(self, target: str, gate_at: str) -> None:
        self.gate_at = gate_at
        self.arrived = threading.Event()
        self.release = threading.Event()
        super().__init__(target)

    def stop(self) -> None:
        self.release.set()
        super().stop()

    def _handler(self) -> type:
        proxy = self
        base = super()._handler()

        class Gating(base):  # type: ignore[misc, valid-type]
            def _forward(self) -> None:
                key = self.path.split("?")[0]
                first = not proxy.arrived.is_set()
                if first and self.command == "PUT" and key.endswith(proxy.gate_at):
                    proxy.arrived.set()
                    assert proxy.release.wait(30)
                super()._forward()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        return Gating


def _objects(prefix: str) -> dict[str, bytes]:
    return {f: cp.storage.read_bytes(f"{prefix}/{f}") for f in cp.storage.list_files(prefix)}


def _overwrite_while(
    s3, path: str, put: dict[str, bytes], *, overwrite: bool = True
) -> cp.AsyncResponse:
    """An async overwrite of ``path`` (or a save); ``put`` written under it (straight to the
    server) while the save writes its metadata (its start, which deletes the old objects,
    is over)."""
    proxy = GatingProxy(s3.endpoint, f"/{path.split('/', 3)[3]}/_CHECKPOINT_METADATA")
    try:
        through = cp.options.StorageOptions(endpoint=proxy.endpoint)
        with cp.Context(storage_options=through):
            saving = cp.save_pytree_async(path, NEW, overwrite=overwrite)
        assert proxy.arrived.wait(30)
        for key, data in put.items():
            cp.storage.write_bytes(f"{path}/{key}", data)
        proxy.release.set()
        saving.exception(30)
    finally:
        proxy.stop()
    return saving


@pytest.mark.parametrize(
    ("put", "shown"),
    [
        ({"mine.txt": b"mine"}, "mine.txt"),
        ({"results/a.csv": b"1,2\n", "results/b.csv": b"3\n"}, "results"),
    ],
    ids=["an object", "a folder"],
)
def test_objects_put_under_the_prefix_while_an_overwrite_writes_stop_it(
    s3, bucket, put, shown
) -> None:
    path = f"{bucket}/ck"
    cp.save_pytree(path, OLD)
    saving = _overwrite_while(s3, path, put)
    with pytest.raises(cp.errors.CheckpointExistsError) as refused:
        saving.result(0)
    message = str(refused.value)
    assert f"{path} changed while this save was writing ({shown} appeared there)" in message
    assert "was not committed" in message and "left as it is" in message, message
    assert _objects(path) == put  # Never deleted; the save's own objects (and record) gone.
    assert not cp.is_checkpoint(path)


def test_an_overwrite_that_met_nothing_new_commits(s3, bucket) -> None:
    path = f"{bucket}/ck"
    cp.save_pytree(path, OLD)
    _overwrite_while(s3, path, {}).result(0)
    loaded = cp.load_pytree(path)
    assert set(loaded) == {"v", "step"} and loaded["step"] == 7


def test_objects_put_under_the_prefix_while_a_new_save_writes_stop_it(s3, bucket) -> None:
    # Committed, the checkpoint would hold them, and its deletion (by a Checkpointer's
    # preservation policy) would delete them.
    path = f"{bucket}/fresh"
    saving = _overwrite_while(s3, path, {"notes.txt": b"mine"}, overwrite=False)
    with pytest.raises(cp.errors.CheckpointExistsError, match=r"notes.txt appeared there"):
        saving.result(0)
    assert _objects(path) == {"notes.txt": b"mine"}
    assert not cp.is_checkpoint(path)


def test_an_object_put_while_finalize_publishes_keeps_the_partial_saves(s3, bucket) -> None:
    # On an object store the session is the path itself: its committed partial saves are
    # the only copy of what the user saved, so a refused finalize must not remove them.
    path = f"{bucket}/assembled"
    cp.partial.save(path, {"a": np.arange(3)})
    cp.partial.save(path, {"b": np.arange(4.0)})
    proxy = GatingProxy(s3.endpoint, f"/{path.split('/', 3)[3]}/_CHECKPOINT_METADATA")
    try:
        errors: list[BaseException] = []
        finalizing = threading.Thread(target=_finalize_into, args=(path, proxy, errors))
        finalizing.start()
        assert proxy.arrived.wait(30)
        cp.storage.write_bytes(f"{path}/notes.txt", b"mine")
        proxy.release.set()
        finalizing.join(30)
    finally:
        proxy.stop()
    assert len(errors) == 1 and isinstance(errors[0], cp.errors.CheckpointExistsError), errors
    assert "partial saves were kept" in str(errors[0]), errors[0]
    assert not cp.is_checkpoint(path)
    cp.storage.remove_file(f"{path}/notes.txt")
    cp.partial.finalize(path)  # Once the object is moved, finalize again publishes both.
    loaded = cp.load_pytree(path)
    np.testing.assert_array_equal(loaded["a"], np.arange(3))
    np.testing.assert_array_equal(loaded["b"], np.arange(4.0))


def _finalize_into(path: str, proxy: S3Proxy, errors: list[BaseException]) -> None:
    try:
        with cp.Context(storage_options=cp.options.StorageOptions(endpoint=proxy.endpoint)):
            cp.partial.finalize(path)
    except BaseException as e:
        errors.append(e)
