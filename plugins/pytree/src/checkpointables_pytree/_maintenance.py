"""Recording a checkpoint's checksums again after its pytree database was rewritten on purpose.

A save records checksums of every file a load reads: ``_CHECKSUMS`` (the
metadata files and the database's manifest) and each pytree's
``_btree_checksums`` (every node of its database's b-tree). Whoever rewrites
a committed database deliberately (re-encodes it with TensorStore, commits
on top of it, compacts it) changes its manifest and nodes, and loads then
refuse it as damaged. ``record_checksums_again`` records both anew, vouching
for whatever the files now hold: call it only on a checkpoint you changed
yourself and trust.

Example::

    rewrite_database(ckpt / "pytree")  # e.g. with TensorStore's ocdbt driver
    checkpointables_pytree.record_checksums_again(ckpt)
    state = cp.load_pytree(ckpt)
"""

from __future__ import annotations

import checkpointables as cp
from etils import epath

from checkpointables_pytree import ocdbt

__all__ = ["record_checksums_again"]


def record_checksums_again(checkpoint: epath.PathLike) -> None:
    """Records the checksums of ``checkpoint`` again, after its files were changed on
    purpose: ``_btree_checksums`` of every checkpointable directory that holds an OCDBT
    database (``pytree/``, ...), then ``_CHECKSUMS``.

    Damage that happened before the call is recorded as the truth: run
    ``checkpointables verify`` on the checkpoint before rewriting it, not after.

    Raises:
      cp.errors.CheckpointNotFoundError: ``checkpoint`` does not exist.
      ValueError: TensorStore cannot read a database's b-tree.
    """
    root = epath.Path(checkpoint)
    if not cp.storage.exists(root):
        raise cp.errors.CheckpointNotFoundError(f"{root} does not exist: nothing to record.")
    for entry in sorted(cp.storage.list_dir(root), key=lambda e: e.name):
        child = root / entry.name
        if entry.is_dir and cp.storage.exists(child / ocdbt.MANIFEST_FILE):
            ocdbt.record_node_checksums(child)
    cp.metadata_checksums.record(root)
