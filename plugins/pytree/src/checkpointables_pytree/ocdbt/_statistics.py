"""What a database's manifest says it holds: the bound on what a load may plan to read."""

from __future__ import annotations

import os

from etils import epath

from checkpointables_pytree.ocdbt import _context
from checkpointables_pytree.ocdbt._dumps import dump

__all__ = ["stored_key_count"]


def stored_key_count(directory: epath.PathLike) -> int | None:
    """How many keys the latest version of the database in ``directory`` holds, as its
    manifest records; ``None`` if that cannot be read (the reads then report why).

    Reads the manifest only (one small file).

    Raises:
      cp.errors.MetadataError: the manifest holds more than ``MAX_MANIFEST_BYTES``.
    """
    root = os.fspath(directory)
    _context.check_manifest_size(root)  # Not in the try: a MetadataError is a ValueError.
    try:
        base = _context.open_location(root).result()
        manifest = dump(base)
    except ValueError:
        return None
    versions = manifest.get("versions") or []
    if not versions:
        return 0
    latest = max(versions, key=lambda v: v.get("generation_number", 0))
    count = ((latest.get("root") or {}).get("statistics") or {}).get("num_keys")
    return count if isinstance(count, int) else None
