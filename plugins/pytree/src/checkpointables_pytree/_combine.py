"""Combining process-local saves of one pytree, each holding other shards of its arrays.

The local tier saves every process's own shards of each global array into a
pytree directory of its own (process-local storage). A restart that needs
shards from several of them (fewer processes, another mesh) asks the handler
for one pytree holding them all (``cp.protocols.CombinesShards``). Every
source was written by the same save, with the same tree and the same chunk
grid (one chunk per saved shard), so an array's chunk has the same key in
every source that holds it, and the same bytes:

* the root OCDBT database is the union of the sources' keys, built by
  ``ocdbt.merge_into``: it only references the sources' data files (a chunk
  held by several sources is taken from one of them);
* every other file (``_METADATA``, ``_sharding``, ``_strings.json``,
  ``array_metadatas/``, files of custom leaf handlers) is copied from the
  first source, which also supplies the values every process holds;
* ``_btree_checksums`` is recorded for the new b-tree, so loads check it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence

from etils import epath

from checkpointables_pytree import ocdbt

__all__ = ["combine_shards"]

# The database's own files: built anew in the target, never copied from a source.
_DATABASE = frozenset({ocdbt.MANIFEST_FILE, "d", ocdbt.NODE_CHECKSUMS_FILE})


def combine_shards(sources: Sequence[epath.Path], target: epath.Path) -> None:
    """Builds at ``target`` the pytree whose database holds every key of ``sources``
    (each inside ``target``, read-only); the rest is the first source's.

    Raises:
      ValueError: no source, or a source is not inside ``target``.
    """
    if not sources:
        raise ValueError(f"Combining shards into {target}: no source pytree directory given.")
    root = os.fspath(target)
    inside = {os.path.relpath(os.fspath(s), root).split(os.sep)[0] for s in sources}
    first = os.fspath(sources[0])
    for name in sorted(os.listdir(first)):
        if name in _DATABASE or name in inside:
            continue
        source, copy = os.path.join(first, name), os.path.join(root, name)
        if os.path.isdir(source):
            shutil.copytree(source, copy, dirs_exist_ok=True)
        else:
            shutil.copyfile(source, copy)
    ocdbt.merge_into(target, [ocdbt.Source(epath.Path(s)) for s in sources])
    ocdbt.record_node_checksums(target)
