"""What the next save of a Checkpointer on an object store takes from the step just committed.

A reusing save on S3 needs its source's record (``_REUSE.json``) and the b-tree
nodes that place the source's chunks before it copies any array to the host:
read then, they cost a dozen requests in its blocking phase. Once a save has
committed (``cp.reuse.SaveReuse.after_commit``), its background thread reads
them back from the committed step instead, between two reads of the step's
identity (its commit marker's content, unique to one commit): kept only if both
are that same identity, so what is kept is what that very commit holds. The
next save uses them only if the identity it read of its source as it started
(``SaveReuse.source_identity``) is that one; otherwise, or where nothing is
kept, it reads its source as before. The data files are listed by every save
(a file changed since is not linked): nothing of them is kept.
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

from checkpointables_pytree import ocdbt

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


def _key(directory: epath.Path) -> str:
    return os.fspath(directory).rstrip("/")


def take(reuse: cp.reuse.SaveReuse, name: str) -> Prefetched | None:
    """What was read of ``reuse``'s source's pytree ``name`` after its commit, if that is
    the commit the save found there (``None``: read it now)."""
    identity = reuse.source_identity  # First: ``None`` where the source is gone.
    source = reuse.source_of(name)
    if source is None or identity is None:
        return None
    with _lock:
        return _kept.get((_key(source), identity))


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
            asyncio.run(index.find(sorted(keys)))
        except (OSError, ValueError, cp.errors.IntegrityError):
            return  # Read again by the next save, which then says what is wrong.
        if identity_of() != first:
            return  # Replaced or deleted meanwhile: what was read may be of two commits.
        with _lock:
            _kept[(_key(directory), first)] = Prefetched(record, index)
            while len(_kept) > _KEPT:
                _kept.popitem(last=False)

    # Run in the save's context (its storage options: endpoint, credentials).
    context = contextvars.copy_context()
    reuse.after_commit(lambda identity_of: context.run(prefetch, identity_of))
