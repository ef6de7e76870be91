"""Pytree readers: ``cp.load_pytree`` of files and directories that are not checkpoints.

A plugin that reads another format (the safetensors plugin reads Hugging
Face ``model.safetensors`` files and sharded sets) registers a reader through
the ``register_pytree_readers`` hook; the reader meets
``cp.protocols.PyTreeReader``. For a path that is a checkpoint directory the
readers are never asked; for any other path, the first reader by
``(priority, name)`` that recognizes it loads it::

    params = cp.load_pytree("gemma/model.safetensors")
    abstract = cp.pytree_metadata("gemma/").metadata     # shapes and dtypes only

``checkpointables plugins`` lists the registered readers.
"""

from __future__ import annotations

from typing import Any

from etils import epath

from checkpointables import layout, plugins, storage
from checkpointables._asyncio import AsyncResponse, run_sync, start_background
from checkpointables.checkpoint_metadata import CheckpointMetadata
from checkpointables.context import Context
from checkpointables.path._parse import as_path
from checkpointables.plugins import ReaderRegistration
from checkpointables.protocols import PyTreeReader

__all__ = ["PyTreeReader", "ReaderRegistration", "registered_readers", "reader_for"]


def registered_readers() -> tuple[ReaderRegistration, ...]:
    """The registered readers, in the order they are asked."""
    return plugins.reader_registrations()


def reader_for(path: epath.PathLike) -> PyTreeReader | None:
    """The reader that recognizes ``path``, or ``None`` (then it is read as a checkpoint).

    A checkpoint directory is never given to a reader. Locally that is checked
    first (two stats); on remote storage only once a reader recognizes the
    path, so that loading a remote checkpoint costs no extra requests.
    """
    path = as_path(path)
    registrations = registered_readers()
    if not registrations:
        return None
    if storage.is_local(path) and layout.is_checkpoint(path):
        return None
    for registration in registrations:
        reader = registration.reader_cls()
        if reader.recognizes(path):
            return None if layout.is_checkpoint(path) else reader
    return None


def load_async(
    reader: PyTreeReader, path: epath.Path, abstract_pytree: Any, context: Context
) -> AsyncResponse[Any]:
    """Runs the reader's blocking phase now and its reading in the background (on the
    caller's thread for ``cp.load_pytree``, whose caller waits)."""
    with context:  # Readers read options through get_context(), like handlers.
        reading = run_sync(reader.load(path, abstract_pytree))

        async def read() -> Any:
            return await reading

        def background() -> Any:
            try:
                return run_sync(read())
            except Exception as e:
                e.add_note(f"while loading {path} with {type(reader).__name__}")
                raise

        return start_background(background, f"load of {path}", daemon=True)


def metadata(reader: PyTreeReader, path: epath.Path, context: Context) -> CheckpointMetadata[Any]:
    """The reader's ``CheckpointMetadata`` of ``path`` (a bare tree is wrapped in one)."""
    with context:
        value = run_sync(reader.metadata(path))
    if isinstance(value, CheckpointMetadata):
        return value
    return CheckpointMetadata(path, metadata=value)
