"""Checksums of a checkpoint's metadata files: recorded at commit, checked on every read.

When a save commits, ``_CHECKSUMS`` is written at the top of the checkpoint.
It lists the CRC-32 of every file at the top level of the checkpoint and at
the top level of each checkpointable directory (``_CHECKPOINT_METADATA``,
``pytree/_METADATA``, ``pytree/_sharding``, ``json/data.json``, ...) of up
to ``MAX_FILE_BYTES``, and ends with the CRC-32 of everything before it::

    {"format":1,"algorithm":"crc32","files":{"_CHECKPOINT_METADATA":"5d2c09e1",
     "pytree/_METADATA":"0c7fa1b3",...},"checksum":"9e4410d2"}

Larger files, and everything in subdirectories, are data that their handlers
check themselves (the pytree handler records a checksum per chunk). Orbax
ignores the file, and reads these checkpoints as before.

Handlers read their metadata files with ``read_file``, which checks them
against the table (one ``stat`` per read once the table is cached). A
checkpoint without ``_CHECKSUMS`` (written by Orbax, or by an earlier
version) is read unchecked. A CRC-32 detects accidental damage (every error
of up to 32 bits in a row, and all but 1 in 2**32 others); it does not stop
someone who rewrites files on purpose and recomputes the checksums.

Example::

    raw = cp.metadata_checksums.read_file(directory / "data.json")
    value = cp.safe_json.loads(raw, source=directory / "data.json")
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import json
import os
import re
import stat
import threading
import zlib
from collections.abc import Iterator, Mapping

import attrs
from etils import epath

from checkpointables import errors, safe_json, storage

__all__ = [
    "CHECKSUMS_FILE",
    "MAX_FILE_BYTES",
    "record",
    "CheckedFile",
    "read_file",
    "read_checked",
    "scope",
    "is_protected",
    "RECORDED_MARK",
    "check_recorded",
    "covered_top_level_names",
    "verify",
]

CHECKSUMS_FILE = "_CHECKSUMS"
# Files above this size are data, not metadata: their handlers check them.
MAX_FILE_BYTES = 256 << 20
FORMAT_VERSION = 1
# The line a save adds to its commit marker (``commit_success.txt``): the checkpoint
# recorded ``_CHECKSUMS``, so a checkpoint without one lost it.
RECORDED_MARK = f"checksums: {CHECKSUMS_FILE}"
_MARKER_FILE = "commit_success.txt"  # layout.COMMIT_SUCCESS_FILE (layout imports this module).
_SEAL = re.compile(rb'(.*),"checksum":"([0-9a-f]{8})"\}\n?', re.DOTALL)
_CACHED_TABLES = 64
_READ_BYTES = 16 << 20


# -- Recording ----------------------------------------------------------------------


def _crc32_of_file(path: str, size: int) -> int:
    if size == 0:
        return 0  # The marker file; nothing to read.
    if not storage.is_local(path):
        return zlib.crc32(storage.read_bytes(path))
    crc = 0
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # Cheaper than open() for small files.
    try:
        while block := os.read(fd, _READ_BYTES):
            crc = zlib.crc32(block, crc)
    finally:
        os.close(fd)
    return crc


def _covered_files(checkpoint: str) -> Iterator[tuple[str, str, int]]:
    """``(name in the table, path, size)`` of every file the table covers, in name order."""
    for name, kind, size in _entries(checkpoint):
        if name.startswith("."):
            continue  # Not part of the checkpoint (e.g. a save's record on an object store).
        path = f"{checkpoint.rstrip('/')}/{name}"
        if kind == "dir":
            for child, child_kind, child_size in _entries(path):
                if child_kind == "file" and child_size <= MAX_FILE_BYTES:
                    yield f"{name}/{child}", f"{path}/{child}", child_size
        elif kind == "file" and name != CHECKSUMS_FILE and size <= MAX_FILE_BYTES:
            yield name, path, size


def _entries(directory: str) -> list[tuple[str, str, int]]:
    """``(name, "file" | "dir" | "other", size)`` of each entry (symlinks are "other").

    On an object store sizes are not listed: they are -1 (unknown), so every
    file at the covered levels is covered (they are small metadata files there too).
    """
    if not storage.is_local(directory):
        listed = storage.list_dir(directory)
        return sorted((e.name, "dir" if e.is_dir else "file", -1) for e in listed)
    result = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                result.append((entry.name, "dir", 0))
            elif entry.is_file(follow_symlinks=False):
                result.append((entry.name, "file", entry.stat(follow_symlinks=False).st_size))
            else:
                result.append((entry.name, "other", 0))
    return sorted(result)


def _sealed(files: Mapping[str, int]) -> bytes:
    body = json.dumps(
        {
            "format": FORMAT_VERSION,
            "algorithm": "crc32",
            "files": {name: f"{crc:08x}" for name, crc in files.items()},
        },
        separators=(",", ":"),
    )[:-1].encode()
    return body + b',"checksum":"%08x"}\n' % zlib.crc32(body)


def record(checkpoint: epath.PathLike, known: Mapping[str, bytes] | None = None) -> None:
    """Writes ``_CHECKSUMS`` for the files of ``checkpoint`` (a save's directory, before
    its commit flushes and renames it). Every file must be written by then.

    ``known``: the contents of files the caller just wrote, by name in the table
    (e.g. ``_CHECKPOINT_METADATA``), checksummed without reading them back.
    """
    root = os.fspath(checkpoint)
    known = known or {}
    files = {
        name: zlib.crc32(known[name]) if name in known else _crc32_of_file(path, size)
        for name, path, size in _covered_files(root)
    }
    storage.write_bytes(os.path.join(root, CHECKSUMS_FILE), _sealed(files))


# -- Reading ------------------------------------------------------------------------


class _Table:
    """The parsed ``_CHECKSUMS`` of one checkpoint."""

    def __init__(self, path: str, raw: bytes) -> None:
        self.path = path
        match = _SEAL.fullmatch(raw)
        if match is None or zlib.crc32(match.group(1)) != int(match.group(2), 16):
            raise errors.IntegrityError(
                f"{path} failed its own checksum: the list of the checkpoint's metadata "
                f"checksums is damaged, so nothing in the checkpoint can be trusted. Restore the "
                f"checkpoint from a copy, or load an older one."
            )
        document = safe_json.loads_object(raw, source=path)
        files = document.get("files")
        if not isinstance(files, dict) or not all(
            isinstance(v, str) and len(v) == 8 for v in files.values()
        ):
            raise errors.MetadataError(f"{path} does not list files and checksums.")
        try:
            self.files = {str(k): int(v, 16) for k, v in files.items()}
        except ValueError:
            raise errors.MetadataError(
                f"{path} holds a checksum that is not hexadecimal."
            ) from None


_tables: dict[str, tuple[tuple[int, ...], _Table]] = {}
_tables_lock = threading.Lock()
# The tables one operation has looked for, by directory: see ``scope``.
_scoped: contextvars.ContextVar[_ScopeTables | None] = contextvars.ContextVar(
    "checkpointables_metadata_checksums_scope", default=None
)


class _ScopeTables:
    """The tables (and absences of tables) looked for in one ``scope``, by directory. The
    scope's threads share it: a lookup another thread has started is waited for, not made
    again (else a load's metadata read and its index would both fetch one remote file)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lookups: dict[str, concurrent.futures.Future[_Table | None]] = {}

    def table_in(self, directory: str) -> _Table | None:
        with self._lock:
            lookup = self._lookups.get(directory)
            started_here = lookup is None
            if lookup is None:
                lookup = self._lookups[directory] = concurrent.futures.Future()
        if started_here:
            try:
                lookup.set_result(_look_for_table(directory))
            except BaseException as e:
                with self._lock:  # A failure is not remembered: the next lookup tries again.
                    del self._lookups[directory]
                lookup.set_exception(e)
        return lookup.result()


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """Within it (one load or metadata read of one checkpoint, including the background
    work it starts), each ``_CHECKSUMS`` is looked for and read once: a remote checkpoint's
    is fetched once, not once per metadata file, nor once per thread reading it at once.

    Example::

        with cp.metadata_checksums.scope():
            meta = read_file(path / "_CHECKPOINT_METADATA")
            tree = read_file(path / "pytree" / "_METADATA")  # No second lookup.
    """
    token = _scoped.set(_ScopeTables())
    try:
        yield
    finally:
        _scoped.reset(token)


def _table_in(directory: str) -> _Table | None:
    """The table at the top of ``directory``, or ``None`` if it has none (remembered within a
    ``scope``; local tables also cached by the file's identity)."""
    seen = _scoped.get()
    if seen is None:
        return _look_for_table(directory)
    return seen.table_in(directory)


def _look_for_table(directory: str) -> _Table | None:
    path = os.path.join(directory, CHECKSUMS_FILE)
    if not storage.is_local(path):
        try:
            data = storage.read_bytes(path, max_bytes=MAX_FILE_BYTES)
        except FileNotFoundError:
            return None
        except errors.MetadataError as e:  # Too large: as on a local disk.
            raise errors.IntegrityError(str(e)) from None
        return _Table(path, data)
    try:
        status = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    identity = (
        status.st_ino,
        status.st_dev,
        status.st_size,
        status.st_mtime_ns,
        status.st_ctime_ns,
        status.st_mode,
    )
    with _tables_lock:
        cached = _tables.get(path)
    if cached is not None and cached[0] == identity:
        return cached[1]
    if stat.S_ISLNK(status.st_mode):
        raise errors.OutsideCheckpointError(
            f"{path} is a symbolic link; a checkpoint's checksums must be stored in it, not "
            f"elsewhere. Replace the link by the file it points to."
        )
    if status.st_size > MAX_FILE_BYTES:
        raise errors.IntegrityError(str(storage.file_too_large(path, MAX_FILE_BYTES)))
    with open(storage.open_regular_file(path), "rb") as f:  # Never a pipe: it would block.
        table = _Table(path, f.read())
    with _tables_lock:
        if len(_tables) >= _CACHED_TABLES:
            _tables.clear()
        _tables[path] = (identity, table)
    return table


def covered_top_level_names(checkpoint: epath.PathLike) -> frozenset[str]:
    """The names directly in ``checkpoint`` that its ``_CHECKSUMS`` covers files of (its own
    files and checkpointable directories); empty without a sound table.

    Example::

        covered_top_level_names("ck")  # frozenset({"_CHECKPOINT_METADATA", "pytree", ...})
    """
    with contextlib.suppress(errors.CheckpointError, OSError):
        table = _table_in(os.fspath(checkpoint))
        if table is not None:
            return frozenset(name.split("/")[0] for name in table.files)
    return frozenset()


def _covering_table(path: str) -> tuple[_Table, str] | None:
    """The table that covers file ``path`` and the file's name in it, or ``None``."""
    directory, name = os.path.split(path)
    table = _table_in(directory)
    if table is not None:
        return table, name
    parent, child = os.path.split(directory)
    table = _table_in(parent) if parent and child else None
    return (table, f"{child}/{name}") if table is not None else None


def _mismatch(path: str, covering: tuple[_Table, str], what: str) -> errors.IntegrityError:
    return errors.IntegrityError(
        f"{path} {what} (checked against {covering[0].path}): the checkpoint was damaged, or "
        f"replaced while it was being read. Load it again; if this persists, restore the "
        f"checkpoint from a copy or load an older one (`checkpointables verify PATH` lists every "
        f"problem)."
    )


def _lost(path: str, covering: tuple[_Table, str]) -> errors.IntegrityError:
    """The error for a file that the table records but is not there: the checkpoint was
    committed with it (``_CHECKSUMS`` is written at the commit) and lost it since."""
    unloadable = ""
    if covering[1] == "_CHECKPOINT_METADATA":  # checkpoint_metadata imports this module.
        unloadable = " (cp.is_checkpoint reports False for it: it cannot be loaded)"
    return errors.IntegrityError(
        f"{path} is missing, although {covering[0].path} records it: the checkpoint was "
        f"committed with it and has lost it since (deleted, or damaged){unloadable}. It is a "
        f"damaged checkpoint, not an unfinished save: restore it from a copy, or load an older "
        f"one (`checkpointables verify PATH` lists every problem)."
    )


@attrs.frozen
class CheckedFile:
    """A metadata file's bytes, and whether they were checked against a recorded checksum."""

    data: bytes
    checked: bool


def read_checked(path: epath.PathLike, *, max_bytes: int | None = None) -> CheckedFile:
    """The bytes of a checkpoint's metadata file, checked against the recorded checksum, and
    whether there was one (see ``read_file``; ``max_bytes``: the most the file may hold)."""
    text_path = os.fspath(path)
    covering = _covering_table(text_path)
    try:
        data = storage.read_bytes(text_path, max_bytes=max_bytes)
    except FileNotFoundError:
        if covering is not None and covering[1] in covering[0].files:
            raise _lost(text_path, covering) from None
        raise
    if covering is None:
        return CheckedFile(data, checked=False)
    expected = covering[0].files.get(covering[1])
    if expected is None:
        if len(data) <= MAX_FILE_BYTES:
            raise _mismatch(text_path, covering, "was not part of the checkpoint when it was saved")
        return CheckedFile(data, checked=False)
    if zlib.crc32(data) != expected:
        raise _mismatch(text_path, covering, "does not match its recorded checksum")
    return CheckedFile(data, checked=True)


def read_file(path: epath.PathLike, *, max_bytes: int | None = None) -> bytes:
    """The bytes of a checkpoint's metadata file, checked against the recorded checksum.

    ``max_bytes``: the most a well-formed file holds (e.g. ``MAX_FILE_BYTES``); a larger
    local file is refused before it is read, so a damaged or hostile one (a sparse file
    of many GiB) costs no memory.

    Raises:
      FileNotFoundError: the file does not exist, and the checkpoint does not
        say it should (it is optional, or the checkpoint records no checksums).
      cp.errors.IntegrityError: the file does not match its recorded checksum,
        is missing although recorded, or was not there when the checkpoint was
        committed.
      cp.errors.MetadataError: the file holds more than ``max_bytes``.
    """
    return read_checked(path, max_bytes=max_bytes).data


def is_protected(checkpoint: epath.PathLike) -> bool:
    """Whether ``checkpoint`` recorded checksums of its metadata files.

    Raises:
      cp.errors.IntegrityError: ``_CHECKSUMS`` exists but is damaged.
    """
    return _table_in(os.fspath(checkpoint)) is not None


def check_recorded(checkpoint: epath.PathLike) -> None:
    """Raises if ``checkpoint`` has no ``_CHECKSUMS`` although its commit marker says its save
    recorded one (``RECORDED_MARK``): the file was lost, and with it every check of the
    metadata. Checkpoints written by Orbax, or before the mark, pass.

    Raises:
      cp.errors.IntegrityError: ``_CHECKSUMS`` is missing although recorded.
    """
    root = os.fspath(checkpoint)
    if _table_in(root) is not None:
        return
    marker = os.path.join(root, _MARKER_FILE)
    try:
        # The mark is on the marker's third line; a marker of many MiB is no marker of ours.
        text = storage.read_bytes(marker, max_bytes=MAX_FILE_BYTES)[:4096]
    except (FileNotFoundError, NotADirectoryError):
        return
    if RECORDED_MARK.encode() in text.splitlines():
        raise errors.IntegrityError(
            f"{os.path.join(root, CHECKSUMS_FILE)} is missing, although {marker} says the "
            f"checkpoint's save recorded it: the checksums of every metadata file were lost, "
            f"so none can be checked. Restore the checkpoint from a copy, or load an older one "
            f"(`checkpointables verify PATH` checks the rest)."
        )


def verify(checkpoint: epath.PathLike) -> list[str]:
    """Every recorded metadata file of ``checkpoint`` that is missing or does not match.

    Empty when all match, or when the checkpoint records no checksums (and its commit
    marker does not say it did: see ``check_recorded``).
    """
    root = os.fspath(checkpoint)
    try:
        table = _table_in(root)
        check_recorded(root)
    except errors.CheckpointError as e:
        return [str(e)]
    if table is None:
        return []
    problems = []
    for name in table.files:
        try:
            # A recorded file was at most MAX_FILE_BYTES: a larger one is refused unread.
            read_file(os.path.join(root, *name.split("/")), max_bytes=MAX_FILE_BYTES)
        except FileNotFoundError:
            problems.append(f"{os.path.join(root, name)} is missing")
        except errors.CheckpointError as e:
            problems.append(str(e))
    return problems
