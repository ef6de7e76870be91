"""Finding temporary directories left behind by saves and deletions that never finished.

Our temporary names record the creating process id and the creation time
(``<name>.checkpointables-tmp-<ns>-<pid>-<hex>``, and ``-old-`` for steps
being deleted). One is provably abandoned when

- its process is gone: another pid that does not exist on this host, in a
  single-process job on a local root (in a multi-host job on shared storage
  the pid may belong to another host, so it proves nothing); or
- it is older than the save timeout (``AsyncOptions.timeout_secs``): every
  wait on a save has given up on it by then.

A live process's in-flight save is neither, so it is never touched. Orbax's
own temporary directories (``.orbax-checkpoint-tmp``) carry no owner, so they
are left alone; they are never listed as steps either way.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterable

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
