"""Finding, and removing, what saves and deletions that never finished left behind.

On local disks a save writes under a temporary name that records the
creating process id, the creation time and a tag of the host
(``<name>.checkpointables-tmp-<ns>-<pid>-<host tag><hex>``, and ``-old-`` for
steps being deleted). On object stores a save writes in place and records the
same facts (and the host) in a ``SaveRecord`` object inside the checkpoint's
prefix.

A running save proves it is alive by a heartbeat: every ``beat_interval``
(a quarter of its ``AsyncOptions.timeout_secs``, at most 5 minutes) the
background machinery (``_inflight.Heartbeat``) sets its temporary directory's
modification time (one ``utime``), or rewrites its record with ``alive_ns``
(one GET and one small PUT). A save that commits or fails within the first
interval pays nothing. The heartbeat stops before the commit and at a discard;
a killed process's heartbeat simply stops. Either kind is provably abandoned when

- its process is gone: another pid that does not exist on this host, in a
  single-process job (the temporary name's host tag, or the record, names
  this host; a name of an older version is taken for this host's); in a
  multi-host job the pid may belong to another host, so it proves nothing; or
- its heartbeat is older than the save timeout (``AsyncOptions.timeout_secs``),
  whatever the save's age: a save still writing, however long, on this host
  or another one sharing the storage, is never taken for a leftover. A save
  without a heartbeat (an older version's: a record without ``alive_ns``, a
  name without a host tag) is abandoned once it is older than the timeout:
  every wait on a save has given up on it by then.

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
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

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
    "beat_interval",
    "heartbeat_ns",
    "remove",
    "remove_unfinished",
]

SAVE_RECORD_FILE = ".checkpointables-save"

logger = logging.getLogger(__name__)


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


# The longest wait between two beats of a save's heartbeat, whatever its timeout: a cleaner
# whose timeout is shorter than the save's (another job's default) still sees it alive.
_LONGEST_BEAT_SECS = 300.0


def beat_interval(timeout_secs: float) -> float:
    """How often a running save refreshes its heartbeat: a quarter of its timeout (a beat
    lost, or late, still leaves it fresh), at most ``_LONGEST_BEAT_SECS``."""
    return min(timeout_secs / 4, _LONGEST_BEAT_SECS)


def is_over(
    started_ns: int,
    pid: int,
    host: str,
    timeout_secs: float,
    now_ns: int,
    alive_ns: int | None = None,
) -> bool:
    """The rule of the module's docstring: its heartbeat (``alive_ns``; ``None``: it has
    none, its start counts) is too old, or its single-process job's process is gone."""
    last_ns = started_ns if alive_ns is None else alive_ns
    if now_ns - last_ns > timeout_secs * 1e9:
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
    # The save's heartbeat (module docstring): when it last said it is alive. ``None``: the
    # record of an older version, which has none. Not part of the record's identity: a save
    # that finds its own record with a later heartbeat finds its own record.
    alive_ns: int | None = attrs.field(default=None, eq=False)

    @classmethod
    def new(cls, *, deleting: bool = False, replacing: bool = False) -> SaveRecord:
        """A record for a save (or deletion) starting now in this process."""
        now = time.time_ns()
        return cls(uuid.uuid4().hex, now, os.getpid(), this_host(), deleting, replacing, now)

    def beating(self) -> SaveRecord:
        """This record with its heartbeat set to now."""
        return attrs.evolve(self, alive_ns=time.time_ns())

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
                None if value.get("alive_ns") is None else int(value["alive_ns"]),
            )
        except (ValueError, TypeError, KeyError, UnicodeDecodeError):
            return None

    def describe(self) -> str:
        """Who and when, for error messages."""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started_ns / 1e9))
        what = "a deletion" if self.deleting else "a save"
        alive = ""
        if self.alive_ns is not None and self.alive_ns != self.started_ns:
            alive = f", alive at {time.strftime('%H:%M:%S', time.localtime(self.alive_ns / 1e9))}"
        return f"{what} started at {started} by process {self.pid} on host {self.host}{alive}"

    def is_abandoned(self, *, timeout_secs: float, now_ns: int | None = None) -> bool:
        """Whether the save or deletion it describes is provably over (a deletion is always
        resumable: deleting twice is harmless)."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        return self.deleting or is_over(
            self.started_ns, self.pid, self.host, timeout_secs, now_ns, self.alive_ns
        )


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


def is_abandoned(
    name: str,
    *,
    timeout_secs: float,
    now_ns: int | None = None,
    directory: epath.PathLike | None = None,
) -> bool:
    """Whether the local temporary entry ``name`` (in ``directory``, where its heartbeat is
    read; ``None``: the rule without a heartbeat) can be deleted without harming anyone."""
    parsed = layout.parse_temporary_name(name)
    if parsed is None:
        return False
    _, created_ns, pid = parsed
    now_ns = time.time_ns() if now_ns is None else now_ns
    if directory is None or layout.temporary_name_host_tag(name) is None:
        return is_over(created_ns, pid, this_host(), timeout_secs, now_ns)
    alive_ns = heartbeat_ns(directory, name)
    if alive_ns is None:  # Gone meanwhile (committed, discarded): nothing to remove.
        return False
    return is_over(created_ns, pid, name_host(name), timeout_secs, now_ns, alive_ns)


def name_host(name: str) -> str:
    """The host that made temporary entry ``name``: this one's name if its host tag says so
    (or it has none: an older version's), else ``""`` (another host: its pid proves nothing)."""
    tag = layout.temporary_name_host_tag(name)
    return this_host() if tag is None or tag == layout.host_tag() else ""


def heartbeat_ns(directory: epath.PathLike, name: str) -> int | None:
    """The last beat of the save writing the local temporary entry ``directory/name``: its
    modification time (one ``lstat``), or the time in its name if later (a step renamed
    aside for deletion keeps its old time). ``None``: the name is an older version's (no
    heartbeat), or the entry is gone."""
    parsed = layout.parse_temporary_name(name)
    if parsed is None or layout.temporary_name_host_tag(name) is None:
        return None
    try:
        return max(os.lstat(_join(directory, name)).st_mtime_ns, parsed[1])
    except OSError:
        return None


def remove_unfinished(
    path: epath.PathLike, only_if: Callable[[SaveRecord | None], bool] | None = None
) -> bool:
    """Deletes an object-store prefix that holds no committed checkpoint, record last;
    returns whether it did (``False``: it found a commit marker, or a record ``only_if``
    refuses, and deleted nothing).

    A save may take the prefix over at any time (another process's, which claims it with
    its own record): the record and the listing are read together right before deleting
    (one round trip, a GET and a LIST), and only the objects listed then are deleted, never
    a commit marker. The record goes last, and only if it is still the one read (one GET
    more): a crash midway leaves it, so the next cleanup finds the leftover again; a save
    that claimed the prefix meanwhile keeps its record (said in the log: objects it wrote
    under the same names since may be gone, which nothing can tell without a conditional
    delete, and it is one writer per path).
    """
    record, files = concurrently(
        _call, [lambda: read_record(path), lambda: storage.list_files(path)]
    )
    if layout.COMMIT_SUCCESS_FILE in files or (only_if is not None and not only_if(record)):
        return False
    concurrently(storage.remove_file, [_join(path, f) for f in files if f != SAVE_RECORD_FILE])
    if record is None:  # None was read: one that came since is a new save's.
        return True
    now = read_record(path)
    if now is not None and _same(now, record):
        storage.remove_file(_join(path, SAVE_RECORD_FILE))
    elif now is not None:
        _warn_taken_over(path, f"{now.describe()}; its record was kept")
    elif storage.is_file(_join(path, layout.COMMIT_SUCCESS_FILE)):  # Gone: committed since?
        _warn_taken_over(path, "it committed since")
    return True


def _warn_taken_over(path: epath.PathLike, what: str) -> None:
    """Says that a save took ``path`` over while ``remove_unfinished`` deleted there."""
    logger.warning(
        "A save claimed %s while a cleanup removed what an unfinished save had left there "
        "(%s). Objects it wrote meanwhile under the names of the removed ones may be gone: "
        "run `checkpointables verify %s`, or save again.",
        path,
        what,
        path,
    )


def _same(a: SaveRecord, b: SaveRecord) -> bool:
    """Whether two records are the same text (heartbeat included: a beat is a live save)."""
    return a == b and a.alive_ns == b.alive_ns


def _call(ask: Callable[[], Any]) -> Any:
    return ask()


def abandoned_entries(
    directories: Iterable[epath.Path], *, timeout_secs: float
) -> list[epath.Path]:
    """The abandoned temporary entries directly inside the local ``directories``."""
    return [
        directory / name
        for directory in directories
        if storage.is_local(directory)
        for name in _names(directory)
        if is_abandoned(name, timeout_secs=timeout_secs, directory=directory)
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
