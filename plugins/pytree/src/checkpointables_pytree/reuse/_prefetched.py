"""What the next save of a Checkpointer on an object store takes from the step just committed.

A reusing save on S3 needs its source's record (``_REUSE.json``) and the b-tree
nodes that place the source's chunks before it copies any array to the host:
read then, they cost a dozen requests in its blocking phase. Once a save has
committed (``cp.reuse.SaveReuse.after_commit``), its background thread reads
them back from the committed step instead, between two reads of the step's
identity (its commit marker's content, unique to one commit): kept only if both
are that same identity, so what is kept is what that very commit holds. The
listing of the data objects those nodes place chunks in (size and ETag) is
made between the same two reads. The next save uses them only if the identity
it read of its source as it started (``SaveReuse.source_identity``) is that
one; otherwise, or where nothing is kept, it reads and lists its source as
before. The objects so listed are listed again in the background before they
are copied (``storage.copy_objects``): one replaced or deleted since fails
that save (nothing is committed). What is kept serves one save (``take``
removes it), so the next lists afresh and writes what changed.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import os
import threading
from collections.abc import Callable, Collection
from typing import Any

import attrs
import checkpointables as cp
from etils import epath

from checkpointables_pytree import ocdbt, storage
from checkpointables_pytree.reuse import _sources

__all__ = ["Prefetched", "after_commit", "take"]

# The newest few steps' (one Checkpointer's next save reads one; several runs in one
# process, a few): each holds the b-tree nodes read, about those of the arrays' keys.
_KEPT = 4
_kept: collections.OrderedDict[tuple[str, Any], Prefetched] = collections.OrderedDict()
_lock = threading.Lock()


@attrs.frozen
class Prefetched:
    """A committed pytree's record (as ``_read_record`` gives it) and its b-tree, with the
    nodes that place the keys of the save that wrote it already read."""

    record: dict[str, Any]
    index: ocdbt.DatabaseIndex
    # The data objects of the directories of data files those nodes name (``directories``),
    # as listed: for ``Source``, which then lists none of them again.
    listed: dict[str, storage.ObjectInfo] = attrs.field(factory=dict)
    directories: frozenset[str] = frozenset()


def _key(directory: epath.Path) -> str:
    return os.fspath(directory).rstrip("/")


def take(reuse: cp.reuse.SaveReuse, name: str) -> Prefetched | None:
    """What was read of ``reuse``'s source's pytree ``name`` after its commit, if that is
    the commit the save found there (``None``: read it now). Taken once: a save that fails
    (a copy refused, its object replaced since it was listed) leaves the next to list."""
    identity = reuse.source_identity  # First: ``None`` where the source is gone.
    source = reuse.source_of(name)
    if source is None or identity is None:
        return None
    with _lock:
        return _kept.pop((_key(source), identity), None)


def after_commit(
    reuse: cp.reuse.SaveReuse,
    directory: epath.Path,
    keys: Collection[str],
    read_record: Callable[[epath.Path], dict[str, Any]],
) -> None:
    """Once the save of pytree ``directory`` (on an object store, written in place) has
    committed, reads its record and the b-tree nodes placing ``keys`` for the next save."""
    if ocdbt.is_local(directory) or not keys:
        return

    def prefetch(identity_of: Callable[[], Any]) -> None:
        first = identity_of()
        if first is None:
            return
        record = read_record(directory)
        index = ocdbt.DatabaseIndex(directory)
        try:
            found = asyncio.run(index.find(sorted(keys)))
            directories = _sources.data_directories(found.values())
            listed = {
                k: attrs.evolve(v, early=True)  # Listed again before a copy (copy_objects).
                for d in directories
                for k, v in storage.list_objects(d).items()
            }
        except (OSError, ValueError, cp.errors.IntegrityError):
            return  # Read again by the next save, which then says what is wrong.
        if identity_of() != first:
            return  # Replaced or deleted meanwhile: what was read may be of two commits.
        with _lock:
            _kept[(_key(directory), first)] = Prefetched(record, index, listed, directories)
            while len(_kept) > _KEPT:
                _kept.popitem(last=False)

    # Run in the save's context (its storage options: endpoint, credentials).
    context = contextvars.copy_context()
    reuse.after_commit(lambda identity_of: context.run(prefetch, identity_of))
