"""Finding what saves and deletions that never finished left behind.

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

from checkpointables import layout, multihost


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


def is_abandoned(name: str, *, timeout_secs: float, pid_proves: bool, now_ns: int) -> bool:
    """Whether the temporary entry ``name`` can be deleted without harming anyone."""
    parsed = layout.parse_temporary_name(name)
    if parsed is None:
        return False
    _, created_ns, pid = parsed
    if now_ns - created_ns > timeout_secs * 1e9:
        return True
    return pid_proves and pid != os.getpid() and not process_exists(pid)


def pid_proves_abandonment(root: epath.Path) -> bool:
    """Whether a dead pid in a temporary name under ``root`` proves the save is dead."""
    return "://" not in os.fspath(root) and multihost.process_count() == 1


def abandoned_entries(
    directories: Iterable[epath.Path], *, timeout_secs: float, now_ns: int | None = None
) -> list[epath.Path]:
    """The abandoned temporary entries directly inside ``directories``."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    found = []
    for directory in directories:
        proves = pid_proves_abandonment(directory)
        try:
            children = list(directory.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            continue
        for child in children:
            if is_abandoned(
                child.name, timeout_secs=timeout_secs, pid_proves=proves, now_ns=now_ns
            ):
                found.append(child)
    return found


def remove(entry: epath.Path) -> None:
    """Deletes an abandoned file or directory tree (already gone is fine)."""
    if entry.is_dir():
        layout.remove_tree(entry)
    else:
        entry.unlink(missing_ok=True)


def this_host() -> str:
    """The name of this machine, as recorded in ``SaveRecord``."""
    return socket.gethostname()


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

    @classmethod
    def new(cls, *, deleting: bool = False) -> SaveRecord:
        """A record for a save (or deletion) starting now in this process."""
        return cls(uuid.uuid4().hex, time.time_ns(), os.getpid(), this_host(), deleting)

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
            )
        except (ValueError, TypeError, KeyError, UnicodeDecodeError):
            return None

    def describe(self) -> str:
        """Who and when, for error messages."""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started_ns / 1e9))
        what = "a deletion" if self.deleting else "a save"
        return f"{what} started at {started} by process {self.pid} on host {self.host}"


def record_is_abandoned(
    record: SaveRecord | None, *, timeout_secs: float, now_ns: int | None = None
) -> bool:
    """Whether the save or deletion ``record`` describes is provably over.

    A deletion is always resumable (deleting twice is harmless); a missing or
    unreadable record proves nothing, except by age, which the caller checks.
    """
    if record is None:
        return False
    if record.deleting:
        return True
    now_ns = time.time_ns() if now_ns is None else now_ns
    if now_ns - record.started_ns > timeout_secs * 1e9:
        return True
    return (
        record.host == this_host()
        and multihost.process_count() == 1
        and record.pid != os.getpid()
        and not process_exists(record.pid)
    )
