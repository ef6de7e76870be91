"""Finding, and removing, what saves and deletions that never finished left behind.

On local disks a save writes under a temporary name that records the
creating process id and the creation time
(``<name>.checkpointables-tmp-<ns>-<pid>-<hex>``, and ``-old-`` for steps
being deleted). On object stores a save writes in place and records the same
facts (and the host) in a ``SaveRecord`` object inside the checkpoint's
prefix. Either is provably abandoned when

- its process is gone: another pid that does not exist on this host, in a
  single-process job (on a local root; on an object store, when the record
  names this host); in a multi-host job the pid may belong to another host,
  so it proves nothing; or
- it is older than the save timeout (``AsyncOptions.timeout_secs``): every
  wait on a save has given up on it by then.

A live process's in-flight save is neither, so it is never touched. Orbax's
own temporary directories (``.orbax-checkpoint-tmp``) carry no owner, so they
are left alone; they are never listed as steps either way. The next save to a
path cleans the abandoned entries of its parent directory (and, on object
stores, an abandoned unfinished save at the path itself); a new
``Checkpointer`` cleans its root.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
import uuid
from collections.abc import Iterable

import attrs
from etils import epath

from checkpointables import layout, multihost, storage
from checkpointables._asyncio import concurrently

__all__ = [
    "SAVE_RECORD_FILE",
    "SaveRecord",
    "read_record",
    "abandoned_entries",
    "abandoned_prefixes",
    "is_over",
    "remove",
    "remove_unfinished",
]

SAVE_RECORD_FILE = ".checkpointables-save"


def process_exists(pid: int) -> bool:
    """Whether a process with this id exists on this host (conservatively True if unsure)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # Exists, owned by someone else.
    except OSError as e:
        return e.errno != errno.ESRCH
    return True


def this_host() -> str:
    """The name of this machine, as recorded in ``SaveRecord``."""
    return socket.gethostname()


def is_over(started_ns: int, pid: int, host: str, timeout_secs: float, now_ns: int) -> bool:
    """The rule of the module's docstring: too old, or its single-process job's process is gone."""
    if now_ns - started_ns > timeout_secs * 1e9:
        return True
    # The job's size last: in a jax.distributed job that has not started JAX's backend yet,
    # asking starts it, which waits for every process (a sibling's save may be over by then).
    return (
        host == this_host()
        and pid != os.getpid()
        and not process_exists(pid)
        and multihost.process_count() == 1
    )


@attrs.frozen
class SaveRecord:
    """Who writes (or deletes) an object-store checkpoint that is not committed.

    Stored as JSON in ``<checkpoint>/.checkpointables-save`` from the start of
    a save until its commit, so that a later save can tell an abandoned
    leftover from a save in progress.
    """

    save_id: str
    started_ns: int
    pid: int
    host: str
    deleting: bool = False
    # A save that replaces a committed checkpoint (``overwrite=True``): a load that meets it
    # says the checkpoint is being replaced (retry), not that there is none.
    replacing: bool = False

    @classmethod
    def new(cls, *, deleting: bool = False, replacing: bool = False) -> SaveRecord:
        """A record for a save (or deletion) starting now in this process."""
        return cls(uuid.uuid4().hex, time.time_ns(), os.getpid(), this_host(), deleting, replacing)

    def to_json(self) -> str:
        """The record's text."""
        return json.dumps(attrs.asdict(self))

    @classmethod
    def from_json(cls, text: bytes | str) -> SaveRecord | None:
        """The record in ``text``, or ``None`` if it is not one (damaged, or written by others)."""
        try:
            value = json.loads(text)
            return cls(
                str(value["save_id"]),
                int(value["started_ns"]),
                int(value["pid"]),
                str(value["host"]),
                bool(value.get("deleting", False)),
                bool(value.get("replacing", False)),
            )
        except (ValueError, TypeError, KeyError, UnicodeDecodeError):
            return None

    def describe(self) -> str:
        """Who and when, for error messages."""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started_ns / 1e9))
        what = "a deletion" if self.deleting else "a save"
        return f"{what} started at {started} by process {self.pid} on host {self.host}"

    def is_abandoned(self, *, timeout_secs: float, now_ns: int | None = None) -> bool:
        """Whether the save or deletion it describes is provably over (a deletion is always
        resumable: deleting twice is harmless)."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        return self.deleting or is_over(self.started_ns, self.pid, self.host, timeout_secs, now_ns)


def _join(path: epath.PathLike, name: str) -> str:
    return f"{os.fspath(path).rstrip('/')}/{name}"


def read_record(path: epath.PathLike) -> SaveRecord | None:
    """The ``SaveRecord`` of an object-store checkpoint's prefix, or ``None``."""
    try:
        return SaveRecord.from_json(storage.read_bytes(_join(path, SAVE_RECORD_FILE)))
    except FileNotFoundError:
        return None


def record_is_abandoned(record: SaveRecord | None, *, timeout_secs: float) -> bool:
    """Whether ``record`` proves its save over; a missing or unreadable one proves nothing."""
    return record is not None and record.is_abandoned(timeout_secs=timeout_secs)


def is_abandoned(name: str, *, timeout_secs: float, now_ns: int | None = None) -> bool:
    """Whether the local temporary entry ``name`` can be deleted without harming anyone."""
    parsed = layout.parse_temporary_name(name)
    if parsed is None:
        return False
    _, created_ns, pid = parsed
    now_ns = time.time_ns() if now_ns is None else now_ns
    return is_over(created_ns, pid, this_host(), timeout_secs, now_ns)


def remove_unfinished(path: epath.PathLike) -> None:
    """Deletes an object-store prefix that holds no committed checkpoint, record last."""
    files = storage.list_files(path)
    concurrently(storage.remove_file, [_join(path, f) for f in files if f != SAVE_RECORD_FILE])
    storage.remove_file(_join(path, SAVE_RECORD_FILE))


def abandoned_entries(
    directories: Iterable[epath.Path], *, timeout_secs: float
) -> list[epath.Path]:
    """The abandoned temporary entries directly inside the local ``directories``."""
    return [
        directory / name
        for directory in directories
        if storage.is_local(directory)
        for name in _names(directory)
        if is_abandoned(name, timeout_secs=timeout_secs)
    ]


def abandoned_prefixes(prefixes: Iterable[epath.Path], *, timeout_secs: float) -> list[epath.Path]:
    """The object-store ``prefixes`` (unfinished saves) whose record proves them abandoned.

    Prefixes without a record (not written by this library) are left alone.
    """
    return [
        prefix
        for prefix in prefixes
        if record_is_abandoned(read_record(prefix), timeout_secs=timeout_secs)
        and not storage.is_file(_join(prefix, layout.COMMIT_SUCCESS_FILE))
    ]


def remove(entries: Iterable[epath.Path]) -> None:
    """Deletes abandoned entries: local files and directory trees, object-store prefixes."""
    for entry in entries:
        if storage.is_local(entry):
            storage.remove_tree(entry)
        else:
            remove_unfinished(entry)


def _names(directory: epath.Path) -> list[str]:
    try:
        return os.listdir(os.fspath(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
