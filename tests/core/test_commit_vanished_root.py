"""A save whose temporary directory is deleted while its handlers write (by one of them, or
by a cleanup) commits nothing, and every handler's failure to write into it is the
``StorageError`` that says so (not a raw ``FileNotFoundError`` naming a file of its own)."""

from __future__ import annotations

import os
import shutil

import checkpointables as cp
import pytest
from etils import epath

from .helpers import SaveOnlyHandler


class Remover:
    """A pytree leaf whose save deletes the save's temporary directory."""


class RemovingLeafHandler:
    """Writes nothing; deletes the save's temporary directory as the pytree saves, before any
    background phase (so the JSON item's write comes after)."""

    def __init__(self, context: cp.Context | None = None) -> None:
        del context

    async def serialize(self, params, serialization_context):
        directory = epath.Path(await serialization_context.parent_dir.await_creation())
        (temporary,) = [p for p in directory.parents if "-tmp-" in p.name]
        shutil.rmtree(temporary)
        return None

    async def deserialize(self, params, deserialization_context):
        raise NotImplementedError

    async def metadata(self, params, deserialization_context):
        return [None for _ in params]


@pytest.fixture
def removing_context():
    registry = cp.serialization.StandardLeafHandlerRegistry()
    registry.add(Remover, Remover, RemovingLeafHandler)
    options = cp.options.PyTreeOptions(leaf_handler_registry=registry)
    with cp.Context(pytree_options=options) as context:
        yield context


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_json_write_into_a_deleted_temporary_directory_is_a_storage_error(
    tmp_path, removing_context, overwrite
) -> None:
    path = tmp_path / "ck"
    if overwrite:
        cp.save_checkpointables(path, {"notes": {"v": 1}})
    # The JSON item first: its error is the one the save raises (the first handler's).
    items = {"notes": {"epoch": 3}, "state": {"w": [1.0], "gone": Remover()}}
    with pytest.raises(cp.errors.StorageError) as raised:
        cp.save_checkpointables(path, items, overwrite=overwrite)
    message = str(raised.value)
    assert "was deleted while it was writing" in message, message
    assert "nothing was committed" in message and os.fspath(path) in message, message
    assert ".checkpointables-tmp-" in message, message
    cause = raised.value.__cause__
    assert isinstance(cause, FileNotFoundError) and "data.json" in str(cause), cause  # JSON's.
    assert sorted(os.listdir(tmp_path)) == (["ck"] if overwrite else [])
    if overwrite:  # The old checkpoint stays, whole.
        assert cp.load_checkpointables(path) == {"notes": {"v": 1}}
    else:
        assert not cp.is_checkpoint(path)


class _NeedsInput:
    """A checkpointable whose handler reads an input file of its own that is missing."""

    def __init__(self, awaits_directory: bool) -> None:
        self.awaits_directory = awaits_directory


class _InputReadingHandler(SaveOnlyHandler):
    """Opens a missing file of the user's in its blocking phase (``save`` itself)."""

    handles = _NeedsInput

    async def save(self, directory, checkpointable):
        if checkpointable.awaits_directory:  # The save's directory made first, then the read.
            await directory.await_creation()
        with open(os.path.join(os.path.dirname(__file__), "no-such-input.txt")) as f:
            f.read()


@pytest.mark.parametrize("awaits_directory", [False, True])
def test_a_handlers_own_missing_file_is_its_own_error(tmp_path, awaits_directory) -> None:
    # The failed save's directory is deleted as it fails: that deletion is not what went wrong.
    cp.handlers.register_handler(_InputReadingHandler, priority=5)
    try:
        with pytest.raises(FileNotFoundError, match="no-such-input.txt") as raised:
            cp.save_checkpointables(tmp_path / "ck", {"input": _NeedsInput(awaits_directory)})
    finally:
        cp.handlers.unregister_handler(_InputReadingHandler)
    assert not isinstance(raised.value, cp.errors.StorageError), raised.value
    assert os.listdir(tmp_path) == []
