"""Import: safetensors data (a file, an index or a directory) as a checkpoint.

The tensors are read in batches of about ``BATCH_BYTES`` and each batch is
added to the checkpoint with ``cp.partial.save``; ``cp.partial.finalize``
publishes it at the end, so nothing appears at the checkpoint's path before
every tensor is written, and memory holds one batch whatever the model's
size. The pytree is the nested dict ``cp.load_pytree`` gives for the same
path (``jax.Array`` leaves); the files' header metadata is kept in the
checkpoint's custom metadata (``safetensors_metadata``), from where
``export`` writes it back.

Under a host-memory budget (``cp.options.MemoryOptions``) batches are a quarter
of it at most and the reads and the saves keep it; a tensor larger than a batch
is read alone, onto the default device (on accelerators piece by piece).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import attrs
import checkpointables as cp
from etils import epath

from checkpointables_safetensors import _names
from checkpointables_safetensors._export import IMPORTED_METADATA_KEY
from checkpointables_safetensors._files import (
    StoredTensor,
    open_tensor_set,
    refuse_inside_checkpoint,
)
from checkpointables_safetensors._reads import ArrayRead, Limits, read_all

__all__ = ["ImportResult", "import_safetensors", "BATCH_BYTES"]

BATCH_BYTES = 1 << 30


@attrs.frozen
class ImportResult:
    """What an import wrote."""

    checkpoint: str
    tensors: int
    nbytes: int
    files: tuple[str, ...]  # The safetensors files read.


def _batches(tensors: Sequence[StoredTensor], limit: int) -> Iterator[list[StoredTensor]]:
    batch: list[StoredTensor] = []
    size = 0
    for tensor in tensors:
        if batch and size + tensor.nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(tensor)
        size += tensor.nbytes
    if batch:
        yield batch


def _check_target(target: epath.Path) -> None:
    """Refuses a ``target`` that is taken: a checkpoint or files there, an unfinished
    session of partial saves, or a place inside a checkpoint. Local paths and object
    stores alike (``cp.storage``): ``target`` itself is the session on an object store.

    Raises:
      cp.errors.CheckpointExistsError, cp.errors.InvalidArgumentError: naming the path.
    """
    session = cp.partial.session_path(target)
    if cp.storage.exists(target):
        if session != target or cp.is_checkpoint(target):
            raise cp.errors.CheckpointExistsError(f"{target} exists; import into a new path.")
        # An object store: partial saves are written at the path itself until finalize.
        raise cp.errors.CheckpointExistsError(
            f"{target} holds objects but no finished checkpoint: the partial saves of an "
            f"earlier, unfinished import or partial save, or other files. Delete them (or call "
            f"cp.partial.finalize on {target} if they are partial saves), or import into a new "
            f"path."
        )
    refuse_inside_checkpoint(target, "a checkpoint")
    if session != target and cp.storage.exists(session):
        raise cp.errors.CheckpointExistsError(
            f"{session} holds the partial saves of an earlier, unfinished import or partial "
            f"save; delete it (or call cp.partial.finalize on {target}) and import again."
        )


def import_safetensors(
    source: os.PathLike[str] | str,
    checkpoint: os.PathLike[str] | str,
    *,
    batch_bytes: int = BATCH_BYTES,
) -> ImportResult:
    """Writes the tensors of ``source`` (local files) as a pytree checkpoint at
    ``checkpoint``, a local path or a URL (``s3://bucket/run/imported``).

    Example::

        import_safetensors("gemma-2b/", "ckpt/gemma-2b")
        params = cp.load_pytree("ckpt/gemma-2b")

    Raises:
      cp.errors.CheckpointExistsError: ``checkpoint`` exists, or an interrupted import
        left its partial save session (delete it, or ``cp.partial.finalize`` it).
      cp.errors.MetadataError: a source file is malformed or truncated.
      cp.errors.InvalidArgumentError: ``checkpoint`` is inside another checkpoint.
    """
    tensor_set = open_tensor_set(source)
    target = cp.path.as_path(checkpoint)
    _check_target(target)
    custom = {
        IMPORTED_METADATA_KEY: dict(tensor_set.metadata),
        "imported_from": os.fspath(source),
    }
    tensors = list(tensor_set.tensors.values())
    if not tensors:
        raise cp.errors.CheckpointError(f"{source} holds no tensor; there is nothing to import.")
    _names.nest(dict.fromkeys(tensor_set.tensors), source=source)  # Name clashes fail first.
    limits = Limits.in_context()
    budget = cp.context.get_context().memory_options.host_bytes
    if budget is not None:
        batch_bytes = min(batch_bytes, budget // 4)
    with cp.progress.bytes_progress(tensor_set.nbytes, "import"):
        for batch in _batches(tensors, batch_bytes):
            values = read_all([ArrayRead.as_stored(t) for t in batch], limits)
            pytree = _names.nest(
                {t.name: v for t, v in zip(batch, values, strict=True)}, source=source
            )
            cp.partial.save(target, pytree, custom_metadata=custom)
            del values, pytree
        cp.partial.finalize(target)
    return ImportResult(os.fspath(target), len(tensors), tensor_set.nbytes, tensor_set.files)
