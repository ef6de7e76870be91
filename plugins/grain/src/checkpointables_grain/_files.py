"""Where iterator states live in a checkpointable directory.

Each process writes ``process_<i>-of-<n>.json`` (the names Grain's own
checkpointing uses). The primary process also writes ``grain_iterator.json``,
describing the save as a whole: which kind of iterator, how many processes.
"""

from __future__ import annotations

import re
from typing import Any

import checkpointables as cp
from etils import epath

__all__ = [
    "INFO_FILE",
    "FORMAT_VERSION",
    "MAX_PROCESS_COUNT",
    "state_file_name",
    "state_files",
    "read_info",
    "write_durably",
]

INFO_FILE = "grain_iterator.json"
FORMAT_VERSION = 1
# More processes than any job runs: a count beyond it is damage, and checking that
# many state files would never end.
MAX_PROCESS_COUNT = 1 << 20
_STATE_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")


def state_file_name(process_index: int, process_count: int) -> str:
    """The state file of one process, e.g. ``process_0-of-2.json``."""
    return f"process_{process_index}-of-{process_count}.json"


def state_files(directory: epath.Path) -> dict[tuple[int, int], epath.Path]:
    """Every state file in ``directory``, keyed by ``(process index, process count)``."""
    found = {}
    for entry in cp.storage.list_dir(directory):
        match = _STATE_FILE.fullmatch(entry.name)
        if match is not None:
            found[(int(match.group(1)), int(match.group(2)))] = directory / entry.name
    return found


def read_info(directory: epath.Path) -> dict[str, Any] | None:
    """The contents of ``grain_iterator.json``, or ``None`` when there is none.

    Checkpoints written by Grain's own handlers, or by Orbax, have none.

    Raises:
      ValueError: the file exists but is not a JSON object with a 'process_count'
        from 1 to ``MAX_PROCESS_COUNT``.
      cp.errors.MetadataError: the file is larger than a metadata file ever is.
    """
    file = directory / INFO_FILE
    if not cp.storage.is_file(file):
        return None
    # Checked against the checksum recorded when the checkpoint was committed.
    raw = cp.metadata_checksums.read_file(file, max_bytes=cp.metadata_checksums.MAX_FILE_BYTES)
    info = cp.safe_json.loads(raw, source=file)
    count = info.get("process_count") if isinstance(info, dict) else None
    if type(count) is not int or not 1 <= count <= MAX_PROCESS_COUNT:
        raise ValueError(
            f"{file} is not a JSON object with an integer 'process_count' from 1 to "
            f"{MAX_PROCESS_COUNT:,}"
        )
    return info


def write_durably(path: epath.Path, text: str) -> None:
    """Writes ``text`` to ``path`` (a local file or an object) durably before returning."""
    cp.storage.write_text(path, text, durable=True)
