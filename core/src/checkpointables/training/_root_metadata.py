"""The root's own metadata file, in the place and format Orbax uses.

``<root>/metadata/_ROOT_METADATA`` holds
``{"internal_metadata": {}, "custom_metadata": {...}}``, so Orbax's
Checkpointer reads ours and we read theirs (also its older
``<root>/metadata/metadata``). The first run that passes ``custom_metadata``
writes it; later runs keep it, as Orbax does, so a resumed run cannot
silently rewrite what the run was started with.

It does not record the step name format (Orbax's does not either, and the
file exists only where ``custom_metadata`` was given): a root opened with
another format is recognized from its directory names (``_listing``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from etils import epath

from checkpointables import errors, layout, metadata_checksums, safe_json, storage

logger = logging.getLogger(__name__)

METADATA_DIR = "metadata"
ROOT_METADATA_FILE = "_ROOT_METADATA"
_LEGACY_FILE = "metadata"


def read(root: epath.Path) -> dict[str, Any]:
    """The stored custom metadata of ``root`` (``{}`` if there is none).

    Raises:
      cp.errors.MetadataError: the file exists but is not the expected JSON.
    """
    for name in (ROOT_METADATA_FILE, _LEGACY_FILE):
        file = root / METADATA_DIR / name
        try:
            raw = storage.read_bytes(file, max_bytes=metadata_checksums.MAX_FILE_BYTES)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            continue
        try:
            value = safe_json.loads_object(raw, source=file)
        except errors.MetadataError as e:
            raise errors.MetadataError(
                f"{e} It is the root's metadata: restore it, or delete the file "
                f"(custom_metadata is then empty)."
            ) from None
        custom = value.get("custom_metadata", {})
        return dict(custom) if isinstance(custom, dict) else {}
    return {}


def write_if_absent(root: epath.Path, custom_metadata: Mapping[str, Any]) -> bool:
    """Writes the root metadata unless a file exists; returns whether it wrote.

    The file appears whole or not at all (locally written aside, flushed and
    renamed; on an object store one PUT is atomic).
    """
    directory = root / METADATA_DIR
    file = directory / ROOT_METADATA_FILE
    if storage.exists(file) or storage.exists(directory / _LEGACY_FILE):
        logger.info("Keeping the existing root metadata of %s.", root)
        return False
    text = json.dumps({"internal_metadata": {}, "custom_metadata": dict(custom_metadata)})
    if not storage.is_local(file):
        storage.write_text(file, text)
        return True
    directory.mkdir(parents=True, exist_ok=True)
    tmp = layout.temporary_path_for(file)
    try:
        storage.write_text(tmp, text, durable=True)
        os.replace(os.fspath(tmp), os.fspath(file))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return True
