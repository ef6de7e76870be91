"""A save whose temporary directory vanishes while it writes fails and commits nothing.

Writes after the save's directories were made never make them again: a data file,
a link, the reuse record or the b-tree's checksums into a directory that someone
deleted fail the save, naming the directory, and the pytree reports its write done
only with its ``_METADATA`` in place. Otherwise the commit would rename a directory
of a few recreated files into a step that ``steps()`` lists and no load can read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import threading

import checkpointables as cp
import jax.numpy as jnp
import numpy as np
import pytest
from checkpointables_pytree import ocdbt, reuse

WAIT_SECS = 10


@dataclasses.dataclass
class Pause:
    """A leaf whose background write says once the save's directory exists (``created``),
    then waits for ``resume``: the test deletes the directory in between."""

    created: threading.Event
    resume: threading.Event


class PauseLeafHandler:
    """Writes nothing; its background phase holds the save as ``Pause`` says."""

    def __init__(self, context: cp.Context | None = None) -> None:
        del context

    async def serialize(self, params, serialization_context):
        pauses = [p.value for p in params]

        async def write() -> None:
            await serialization_context.parent_dir.await_creation()
            for pause in pauses:
                pause.created.set()
                assert await asyncio.to_thread(pause.resume.wait, WAIT_SECS)

        return write()

    async def deserialize(self, params, deserialization_context):
        raise NotImplementedError

    async def metadata(self, params, deserialization_context):
        return [None for _ in params]


@pytest.fixture
def paused_context():
    registry = cp.serialization.StandardLeafHandlerRegistry()
    registry.add(Pause, Pause, PauseLeafHandler)
    options = cp.options.PyTreeOptions(leaf_handler_registry=registry)
    with cp.Context(pytree_options=options) as context:
        yield context


@pytest.mark.fast_path
@pytest.mark.parametrize("reuse_unchanged", [True, False])
def test_a_save_whose_temporary_directory_vanishes_commits_nothing(
    tmp_path, paused_context, reuse_unchanged
) -> None:
    root = tmp_path / "run"
    pause = Pause(threading.Event(), threading.Event())
    checkpointer = cp.training.Checkpointer(
        root, reuse_unchanged=reuse_unchanged, context=paused_context
    )
    with checkpointer:
        checkpointer.save_pytree(0, {"w": jnp.ones(3)}, force=True)
        tree = {"w": jnp.ones((256, 256)), "pause": pause}
        response = checkpointer.save_pytree_async(1, tree, force=True)
        assert pause.created.wait(WAIT_SECS)
        (temporary,) = [n for n in os.listdir(root) if "-tmp-" in n]
        _delete(root / temporary)
        pause.resume.set()
        with pytest.raises((cp.errors.StorageError, FileNotFoundError)) as raised:
            response.result(timeout=WAIT_SECS)
        assert [info.step for info in checkpointer.steps()] == [0]
    assert temporary in str(raised.value)
    assert sorted(os.listdir(root)) == ["0"]


def _delete(directory) -> None:
    """Deletes ``directory``, again while the save's array writes (not held by the pause)
    still add files into it."""
    while directory.exists():
        shutil.rmtree(directory, ignore_errors=True)


def test_a_data_file_is_never_written_into_a_directory_made_again(tmp_path) -> None:
    (tmp_path / "save-tmp-1").mkdir()  # As the commit's protocol makes it.
    database = tmp_path / "save-tmp-1" / "state"
    first = ocdbt.DataFile("d/0001", [b"x" * 100])
    ocdbt.write_local_file(os.fspath(database), first, flush=False)  # Makes d/ below state.
    shutil.rmtree(tmp_path / "save-tmp-1")
    second = ocdbt.DataFile("d/0002", [np.zeros(100, np.uint8)])
    with pytest.raises(cp.errors.StorageError, match="vanished") as raised:
        ocdbt.write_local_file(os.fspath(database), second, flush=False)
    assert os.fspath(tmp_path / "save-tmp-1") in str(raised.value)
    assert not (tmp_path / "save-tmp-1").exists()


def test_a_link_into_a_vanished_database_fails(tmp_path) -> None:
    source = tmp_path / "source"
    source.write_bytes(b"y" * 100)
    database = tmp_path / "save-tmp-1" / "state"
    with pytest.raises(cp.errors.StorageError, match="vanished"):
        ocdbt.link_files(database, [ocdbt.Linked(os.fspath(source), 0, 100)])
    assert not (tmp_path / "save-tmp-1").exists()


def test_the_reuse_record_is_not_written_into_a_vanished_directory(tmp_path) -> None:
    pytree = tmp_path / "save-tmp-1" / "state"
    with pytest.raises(cp.errors.StorageError, match="vanished"):
        reuse.ReusePlan(record={}).write(pytree)
    assert not (tmp_path / "save-tmp-1").exists()
