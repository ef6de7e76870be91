"""What a pytree save does differently when several processes save one checkpoint.

In a ``jax.distributed`` job every process calls the same save with the same
pytree. Orbax's format, which we keep, splits the work like this:

* each process writes the shards of global ``jax.Array``\\ s it owns (those
  with ``replica_id == 0``, so a replicated shard is written once) into its
  own OCDBT database ``ocdbt.process_<i>/``: no two processes ever write one
  manifest;
* values every process holds (NumPy arrays, scalars, bytes, process-local
  ``jax.Array``\\ s) and every array's ``zarr.json`` are written by the
  primary host alone, as are ``_METADATA``, ``_sharding`` and ``_strings.json``;
* after every process finished, the primary host merges the per-process
  databases into the pytree directory's root database (``finalize``). The
  merge copies no data: the root b-tree points into ``ocdbt.process_<i>/d/``.

With ``MultiprocessingOptions(primary_host=None)`` every process saves on
its own, to its own path (process-local storage): it writes everything it
holds, including every distinct shard of a global array on its devices.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import checkpointables as cp
import jax
from etils import epath

from checkpointables_pytree import ocdbt

__all__ = [
    "PROCESS_DATABASE_PREFIX",
    "process_database",
    "writes_shared_values",
    "arrays_the_primary_lacks",
    "shards_to_write",
    "chunk_shape_of",
    "merge_process_databases",
    "flush_database",
]

PROCESS_DATABASE_PREFIX = "ocdbt.process_"
_MANIFEST = "manifest.ocdbt"


def process_database(pytree_directory: epath.Path, index: int) -> epath.Path:
    """The directory of process ``index``'s own database."""
    return pytree_directory / f"{PROCESS_DATABASE_PREFIX}{index}"


def writes_shared_values(context: cp.Context) -> bool:
    """Whether this process writes what every process holds (only the primary host does)."""
    return cp.multihost.is_primary_host(context)


def arrays_the_primary_lacks(
    arrays: Mapping[str, jax.Array],
    directory: cp.path.PathAwaitingCreation,
    context: cp.Context,
    *,
    asker: str,
) -> frozenset[str]:
    """The names of the arrays of which the primary host holds no shard.

    ``asker`` names the caller (e.g. the leaf handler's class): every process
    asks once per save and per asker, in the same order; one save may ask for
    several handlers' arrays (a tree of ``jax.Array``\\ s and PRNG keys).

    On its own, a process cannot tell a process-local array (every process has
    its own; the primary's is saved) from a global array whose devices all
    belong to this process: both are fully addressable here. The primary host
    can: it publishes the arrays it holds no shard of, and the process that
    holds such an array writes it.
    """
    if cp.multihost.process_count() == 1 or not cp.multihost.is_coordinated(context):
        return frozenset()
    lacking = None
    if writes_shared_values(context):
        lacking = json.dumps(sorted(n for n, a in arrays.items() if not a.addressable_shards))
    # The temporary directory's name is unique to this save and the same on every process.
    published = cp.multihost.broadcast_from_primary(
        f"pytree/{directory.path}/lacking/{asker}", lacking, context=context
    )
    return frozenset(json.loads(published))


def shards_to_write(
    array: jax.Array, context: cp.Context, *, primary_lacks: bool = False
) -> list[Any]:
    """The addressable shards of ``array`` this process writes.

    Alone, or for a global array in a coordinated save: the shards with
    ``replica_id == 0`` (each part of the array is written once, by the
    process holding its first replica). A process-local array (fully
    addressable) in a coordinated multi-process save is a value every process
    holds: only the primary host writes it, unless the primary holds no
    shard of it (``primary_lacks``, see ``arrays_the_primary_lacks``). With
    process-local storage (``primary_host=None``) a process writes one replica
    of every distinct shard on its devices.
    """
    shards = array.addressable_shards
    if cp.multihost.process_count() == 1:
        return [s for s in shards if s.replica_id == 0]
    if cp.multihost.is_coordinated(context):
        if array.is_fully_addressable and not (writes_shared_values(context) or primary_lacks):
            return []
        return [s for s in shards if s.replica_id == 0]
    chosen: dict[tuple[tuple[int, int], ...], Any] = {}
    shape = tuple(int(s) for s in array.shape)
    for shard in sorted(shards, key=lambda s: s.replica_id):
        key = tuple(index.indices(size)[:2] for index, size in zip(shard.index, shape, strict=True))
        chosen.setdefault(key, shard)
    return list(chosen.values())


def chunk_shape_of(array: jax.Array) -> tuple[int, ...]:
    """The chunk shape a save gives ``array``: its shards' (uneven ones: the largest)."""
    try:
        return tuple(int(s) for s in array.sharding.shard_shape(array.shape))
    except (ValueError, NotImplementedError):
        return tuple(
            max(int(s.data.shape[d]) for s in array.addressable_shards)
            for d in range(len(array.shape))
        )


def _sources(pytree_directory: epath.Path, context: cp.Context) -> list[epath.Path]:
    if cp.multihost.is_coordinated(context):
        indices = cp.multihost.participating_processes(context)
    else:
        indices = [cp.multihost.process_index()]
    found = []
    for index in indices:
        database = process_database(pytree_directory, index)
        # A process that had no array to write created no database.
        if cp.storage.exists(database / _MANIFEST):
            found.append(database)
    return found


def merge_process_databases(pytree_directory: epath.Path, context: cp.Context) -> int:
    """Merges every process's database into the root one; returns how many were merged.

    Keys never overlap (each chunk and each ``zarr.json`` has one writer),
    so the merge is one atomic transaction that copies no data.
    """
    sources = _sources(pytree_directory, context)
    if sources:
        ocdbt.merge_into(pytree_directory, [ocdbt.Source(d) for d in sources])
    return len(sources)


def flush_database(database: epath.Path) -> None:
    """Flushes a process's own database files to disk.

    The primary host's commit flushes the whole checkpoint, but on storage
    shared between hosts only the writer can make its own writes durable, so
    every process flushes its database before reporting that it finished.
    (An object store's writes are durable once acknowledged: nothing to do.)
    """
    if not cp.storage.is_local(database):
        return
    for root, _, files in os.walk(os.fspath(database)):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
