"""Where checkpoints live: one small interface to the local disk and to object stores.

Everything the library does to storage outside of array data goes through a
``Storage``: read and write small files, check existence, list, delete a
directory tree. Local paths use the built-in ``LocalStorage``; URLs such as
``s3://bucket/run/1`` or ``gs://bucket/run/1`` use the backend a plugin
registered for their scheme (the pytree plugin registers ``s3`` and ``gs``,
through TensorStore's key-value stores, configured by ``cp.options.StorageOptions``
and the standard AWS settings).

Plugins that write files should use the functions of this module rather than
``open()``, so that their checkpointables work on object stores too::

    import checkpointables as cp

    async def save(self, directory, checkpointable):
        async def write():
            path = await directory.await_creation()
            cp.storage.write_text(path / "point.json", json.dumps(...))
        return write()

    async def load(self, directory, abstract=None):
        text = cp.storage.read_text(directory / "point.json")

Local reads accept regular files only: a named pipe, a socket, a device or a
directory where a file is expected raises ``cp.errors.IntegrityError`` at
once instead of blocking forever. Code that opens a checkpoint's files
itself (``os.open``, for ``pread``) uses ``open_regular_file`` for the same.

A backend is registered by a plugin hook::

    @cp.hookimpl
    def register_storage(register):
        register("s3", lambda context: MyS3Storage(context.storage_options))

The two kinds of storage commit a save differently (see ``atomic_rename``
and ``docs/object-stores.md``); ``Storage`` says which kind it is, the core
picks the protocol.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs

from checkpointables import errors

if TYPE_CHECKING:
    from checkpointables.context import Context

__all__ = [
    "Storage",
    "BoundedReads",
    "Versions",
    "Entry",
    "LocalStorage",
    "MissingStorageError",
    "PathIsAFileError",
    "StorageFactory",
    "for_path",
    "scheme_of",
    "is_local",
    "key",
    "read_bytes",
    "read_text",
    "file_too_large",
    "open_regular_file",
    "not_a_regular_file",
    "write_bytes",
    "write_text",
    "exists",
    "is_file",
    "is_dir",
    "list_dir",
    "list_files",
    "remove_file",
    "remove_tree",
    "make_dirs",
    "unfollowable_link",
]

# What to install for the schemes our own plugins serve.
_EXTRAS = {"s3": "checkpointables[s3]", "gs": "checkpointables[gcs]"}


@attrs.frozen
class Entry:
    """A child of a directory: its name and whether it is a directory (a prefix)."""

    name: str
    is_dir: bool


@runtime_checkable
class Storage(Protocol):
    """File operations on one kind of storage; paths are local paths or URLs, as strings.

    Attributes:
      atomic_rename: True where a directory can be renamed atomically (local
        disks): a save is written under a temporary name and renamed into
        place. False on object stores, which have neither renames nor
        directories: a save is written in place and committed by a marker
        object written last.
    """

    atomic_rename: bool

    def read_bytes(self, path: str) -> bytes:
        """The contents of a file. Raises ``FileNotFoundError`` if there is none (and, for a
        local path that is not a regular file, ``cp.errors.IntegrityError``)."""
        ...

    def write_bytes(self, path: str, data: bytes, durable: bool = False) -> None:
        """Creates or replaces a file, whole (on object stores one PUT).

        ``durable``: on a disk, flushed before returning (a commit flushes every
        file of a checkpoint anyway; only a writer can flush its own files on
        storage shared between hosts). Object stores are durable once a write
        is acknowledged.
        """
        ...

    def exists(self, path: str) -> bool:
        """Whether a file, or a directory holding anything, is at ``path``."""
        ...

    def is_file(self, path: str) -> bool:
        """Whether a file (an object) is at ``path``."""
        ...

    def list_dir(self, path: str) -> list[Entry]:
        """The children of a directory, in no particular order (``[]`` if there is none)."""
        ...

    def list_files(self, path: str) -> list[str]:
        """Every file under ``path``, as paths relative to it (``[]`` if there is none)."""
        ...

    def remove_file(self, path: str) -> None:
        """Deletes a file; a missing one is fine."""
        ...

    def remove_tree(self, path: str) -> None:
        """Deletes a directory and everything under it; a missing one is fine."""
        ...

    def make_dirs(self, path: str, mode: int | None = None) -> None:
        """Creates a directory and its parents (a no-op on object stores)."""
        ...


@runtime_checkable
class BoundedReads(Protocol):
    """A ``Storage`` that reads a file only up to a size: a file larger than that costs no
    more than the size in memory and transfer (a local file: nothing, by its size; an
    ``s3://`` or ``gs://`` object: a ranged GET of one byte, at the size). ``read_bytes(path,
    max_bytes=...)`` uses it; on a storage without it a file is read whole before it is
    found too large."""

    def read_bytes_within(self, path: str, max_bytes: int) -> bytes | None:
        """The contents of a file, or ``None`` if it holds more than ``max_bytes``. Raises as
        ``Storage.read_bytes``."""
        ...


@runtime_checkable
class Versions(Protocol):
    """A ``Storage`` that tells a file's version without reading it: an ``s3://`` object's
    ETag or a ``gs://`` object's generation, from one HEAD (no body). A load tells the
    checkpoint it opened from one that replaced it by the version of its commit marker
    (``commit_success.txt``); without this, by the marker's contents (a bounded read)."""

    def version(self, path: str) -> bytes | None:
        """An opaque token that differs whenever the file was written with other contents
        since (it may differ after a rewrite of the same contents too), or ``None`` if there
        is no file at ``path``."""
        ...


StorageFactory = Callable[["Context"], Storage]


class MissingStorageError(errors.UnsupportedPathError):
    """No installed plugin serves the scheme of a path (``s3://``, ``gs://``, ...)."""


class PathIsAFileError(errors.InvalidArgumentError, NotADirectoryError):
    """A directory cannot be created where a file is (the path, or one of its parents).
    Both a ``cp.errors.InvalidArgumentError`` and the builtin ``NotADirectoryError``."""

    def __init__(self, code: int, message: str) -> None:
        NotADirectoryError.__init__(self, code, message)

    def __str__(self) -> str:
        return f"{self.strerror}."


class LocalStorage:
    """The local file system, through ``os`` calls."""

    atomic_rename = True

    def read_bytes(self, path: str) -> bytes:
        """The contents of a regular file (anything else: ``cp.errors.IntegrityError``)."""
        data = self._read(path, None)
        assert data is not None  # Only a bound refuses a file.
        return data

    def read_bytes_within(self, path: str, max_bytes: int) -> bytes | None:
        """``read_bytes``, or ``None`` for a file larger than ``max_bytes`` (by its size,
        before anything is read)."""
        return self._read(path, max_bytes)

    def _read(self, path: str, max_bytes: int | None) -> bytes | None:
        fd, size = _open_regular(path)
        try:
            if max_bytes is not None and size > max_bytes:
                return None
            # Plain reads of the size fstat gave (one byte more: a file grown since reads on),
            # not a buffered file object: a load opens a few small files, and that object's own
            # checks cost as much as the read (0.1 ms a file here).
            chunk = os.read(fd, size + 1)
            parts, total = [], 0
            while chunk:
                parts.append(chunk)
                total += len(chunk)
                if max_bytes is not None and total > max_bytes:
                    return None  # Grown past the bound since fstat: not read on.
                chunk = os.read(fd, _READ_BYTES)
            return parts[0] if len(parts) == 1 else b"".join(parts)
        finally:
            os.close(fd)

    def write_bytes(self, path: str, data: bytes, durable: bool = False) -> None:
        """Writes a file (flushed to disk only if ``durable``)."""
        with open(path, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())

    def exists(self, path: str) -> bool:
        """Whether anything is at ``path``."""
        return os.path.lexists(path)

    def is_file(self, path: str) -> bool:
        """Whether a regular file is at ``path``."""
        return os.path.isfile(path)

    def list_dir(self, path: str) -> list[Entry]:
        """The children of a directory (``[]`` if it does not exist)."""
        try:
            with os.scandir(path) as entries:
                return [Entry(e.name, _is_dir(e)) for e in entries]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def list_files(self, path: str) -> list[str]:
        """Every file under ``path``, relative to it."""
        found = []
        for root, _, files in os.walk(path):
            relative = os.path.relpath(root, path)
            found += [f if relative == "." else os.path.join(relative, f) for f in files]
        return found

    def remove_file(self, path: str) -> None:
        """Deletes a file; a missing one is fine."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def remove_tree(self, path: str) -> None:
        """Deletes a directory tree (or a file, or a symbolic link); a missing one is fine."""
        if os.path.islink(path) or os.path.isfile(path):
            self.remove_file(path)
            return
        shutil.rmtree(path, ignore_errors=True)

    def make_dirs(self, path: str, mode: int | None = None) -> None:
        """Creates a directory and its parents.

        Raises:
          PathIsAFileError: ``path`` or one of its parents is a file.
        """
        try:
            os.makedirs(path, mode=0o777 if mode is None else mode, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as e:
            blocking = _non_directory_in(path)
            if blocking is None:
                raise
            raise PathIsAFileError(
                errno.ENOTDIR,
                f"Cannot create the directory {path}: {blocking} is a file, not a directory. "
                f"Choose a path whose parents are directories, or move {blocking} away",
            ) from e


def _non_directory_in(path: str) -> str | None:
    """The first of ``path`` and its parents that exists but is no directory, or ``None``."""
    parts = os.path.normpath(path).split(os.sep)
    for end in range(1, len(parts) + 1):
        prefix = os.sep.join(parts[:end]) or os.sep
        if os.path.exists(prefix) and not os.path.isdir(prefix):
            return prefix
    return None


_LOCAL = LocalStorage()

_KINDS = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:  # A symbolic link loop: no directory, as a dangling link is none either.
        return False


def unfollowable_link(path: str) -> str:
    """The first symbolic link on the local ``path`` that the system cannot follow (it
    loops, or leads through more links than the system follows: ``ELOOP``); ``path``
    itself where none is found. A ``stat`` per component: for error messages only."""
    prefix = ""
    for part in path.split(os.sep):
        prefix = os.path.join(prefix, part) if prefix else (part or os.sep)
        try:
            os.stat(prefix)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return prefix
    return path


def link_loop(path: os.PathLike[str] | str) -> errors.IntegrityError:
    """The error for a local ``path`` the system cannot resolve: a symbolic link on it
    leads back to itself (``ELOOP``). The message names that link."""
    link = unfollowable_link(os.fspath(path))
    try:
        target = f" (to {os.readlink(link)!r})"
    except OSError:  # Replaced since: the message stands without it.
        target = ""
    return errors.IntegrityError(
        f"{link} is a symbolic link{target} that leads back to itself (a loop) or through "
        f"more links than the system follows, so nothing can be read through it. A link in "
        f"a checkpoint must lead to a file or directory in it: it was damaged or tampered "
        f"with. Replace the link with what it stands for (restore the checkpoint from a "
        f"copy), or load an older checkpoint."
    )


def not_a_regular_file(path: os.PathLike[str] | str, mode: int) -> errors.IntegrityError:
    """The error for ``path``, found to be no regular file (``mode``: its ``st_mode``)."""
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return errors.IntegrityError(
        f"{os.fspath(path)} is {kind}, where a regular file was expected; nothing was read "
        f"from it (reading a pipe or a device can wait forever). The files of a checkpoint are "
        f"regular files: it was damaged or tampered with. Replace it with the file it stands "
        f"for (restore the checkpoint from a copy), or load an older checkpoint."
    )


def open_regular_file(path: os.PathLike[str] | str) -> int:
    """A descriptor of the local regular file at ``path``, open for reading; close it with
    ``os.close``. Symbolic links are followed.

    Anything else is refused at once, before a byte is read: a named pipe
    (FIFO), whose ``open()`` would wait forever for a writer, a socket, a
    device, a directory. The file is opened without waiting and checked
    through the descriptor (``fstat``), so it cannot be swapped for a pipe
    between the check and the read. Read every file of a checkpoint that you
    open yourself (rather than through ``read_bytes``) with it::

        fd = cp.storage.open_regular_file(directory / "table.bin")
        try:
            header = os.pread(fd, 64, 0)
        finally:
            os.close(fd)

    Raises:
      FileNotFoundError: nothing is at ``path`` (other ``OSError``s as ``os.open``).
      cp.errors.IntegrityError: what is at ``path`` is not a regular file, or a symbolic
        link on it loops.
    """
    fd, _ = _open_regular(path)
    os.set_blocking(fd, True)  # Reads then block as usual, on every system.
    return fd


_READ_BYTES = 1 << 24  # What one read asks for after the first.


def _open_regular(path: os.PathLike[str] | str) -> tuple[int, int]:
    """``open_regular_file`` and the file's size then; on Linux, which ignores it for
    regular files, the descriptor keeps ``O_NONBLOCK`` (two system calls fewer)."""
    text = os.fspath(path)
    try:
        # O_NONBLOCK: opening a FIFO for reading returns at once instead of waiting for a writer.
        fd = os.open(text, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise link_loop(text) from None
        if e.errno != errno.ENXIO:  # ENXIO: a socket, or a device with nothing behind it.
            raise
        raise not_a_regular_file(text, os.stat(text).st_mode) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise not_a_regular_file(text, info.st_mode)
        if sys.platform != "linux":  # Linux ignores the flag for regular files; not everywhere.
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def scheme_of(path: os.PathLike[str] | str) -> str | None:
    """The URL scheme of ``path`` (``"s3"``, ``"gs"``), or ``None`` for a local path."""
    text = os.fspath(path)
    head, sep, _ = text.partition("://")
    return head if sep and "/" not in head else None


def is_local(path: os.PathLike[str] | str) -> bool:
    """Whether ``path`` is on the local file system."""
    return scheme_of(path) is None


def key(path: os.PathLike[str] | str) -> str:
    """``path`` as a stable text (absolute if local), to recognize it in this process."""
    text = os.fspath(path)
    return os.path.abspath(text) if is_local(text) else text


def for_path(path: os.PathLike[str] | str, context: Context | None = None) -> Storage:
    """The storage that serves ``path``, configured by ``context`` (default: the one in force).

    Raises:
      MissingStorageError: no installed plugin serves the path's scheme; the
        message names what to install.
      InvalidArgumentError: an ``s3://`` or ``gs://`` URL names no bucket, or an
        S3 bucket name TensorStore refuses.
    """
    scheme = scheme_of(path)
    if scheme is None:
        return _LOCAL
    from checkpointables import context as context_lib
    from checkpointables import plugins
    from checkpointables.path import _parse

    # Strings given here directly (not through cp.path.as_path) are checked too: TensorStore
    # refuses a bad S3 bucket name with a bare ValueError.
    _parse.check_bucket(os.fspath(path))

    factory = plugins.storage_factories().get(scheme)
    if factory is None:
        extra = _EXTRAS.get(scheme)
        hint = (
            f'pip install "{extra}"'
            if extra
            else "install a plugin that registers a storage for it (see docs/object-stores.md)"
        )
        raise MissingStorageError(
            f"Cannot reach {os.fspath(path)}: no installed plugin serves {scheme}:// paths. To "
            f"use them: {hint} (`checkpointables plugins` lists what is installed)."
        )
    return factory(context_lib.get_context(context))


def read_bytes(path: os.PathLike[str] | str, *, max_bytes: int | None = None) -> bytes:
    """The contents of a file, local or remote.

    ``max_bytes``: the most a well-formed file holds (a checkpoint's metadata:
    ``cp.metadata_checksums.MAX_FILE_BYTES``). A larger file is refused, before
    it is read where the storage has ``BoundedReads`` (the local disk, and
    ``s3://`` and ``gs://``, where it costs a GET more), so a damaged or hostile
    one (a sparse file or an object of many GiB) costs no memory there;
    elsewhere once read::

        raw = cp.storage.read_bytes(directory / "state.json", max_bytes=1 << 20)

    Raises:
      FileNotFoundError: there is no file at ``path``.
      cp.errors.IntegrityError: a local ``path`` is not a regular file (a named
        pipe, a directory, ...; see ``open_regular_file``).
      cp.errors.MetadataError: the file holds more than ``max_bytes``
        (``file_too_large``).
    """
    text = os.fspath(path)
    backend = for_path(text)
    if max_bytes is None:
        return backend.read_bytes(text)
    if isinstance(backend, BoundedReads):
        data = backend.read_bytes_within(text, max_bytes)
    else:
        data = backend.read_bytes(text)
    if data is None or len(data) > max_bytes:
        raise file_too_large(text, max_bytes)
    return data


def file_too_large(path: os.PathLike[str] | str, max_bytes: int) -> errors.MetadataError:
    """The error for a checkpoint's file found to hold more than ``max_bytes``."""
    return errors.MetadataError(
        f"{os.fspath(path)} holds more than {max_bytes:,} bytes, more than such a file ever "
        f"holds: the checkpoint is damaged or was not written by a checkpoint library. Restore "
        f"it from a copy or load an older checkpoint."
    )


def read_text(path: os.PathLike[str] | str) -> str:
    """The text (UTF-8) of a file, local or remote; raises as ``read_bytes``."""
    return read_bytes(path).decode("utf-8")


def write_bytes(path: os.PathLike[str] | str, data: bytes, *, durable: bool = False) -> None:
    """Creates or replaces a file, local or remote (``durable``: see ``Storage.write_bytes``)."""
    for_path(path).write_bytes(os.fspath(path), data, durable)


def write_text(path: os.PathLike[str] | str, text: str, *, durable: bool = False) -> None:
    """Creates or replaces a text file (UTF-8), local or remote."""
    write_bytes(path, text.encode("utf-8"), durable=durable)


def exists(path: os.PathLike[str] | str) -> bool:
    """Whether a file, or a directory holding anything, is at ``path``."""
    return for_path(path).exists(os.fspath(path))


def is_file(path: os.PathLike[str] | str) -> bool:
    """Whether a file (an object) is at ``path``."""
    return for_path(path).is_file(os.fspath(path))


def is_dir(path: os.PathLike[str] | str) -> bool:
    """Whether a directory (on object stores: a prefix holding objects) is at ``path``."""
    text = os.fspath(path)
    storage = for_path(text)
    if isinstance(storage, LocalStorage):
        return os.path.isdir(text)
    return bool(storage.list_dir(text))


def list_dir(path: os.PathLike[str] | str) -> list[Entry]:
    """The children of a directory, sorted by name (``[]`` if there is none)."""
    return sorted(for_path(path).list_dir(os.fspath(path)), key=lambda e: e.name)


def list_files(path: os.PathLike[str] | str) -> list[str]:
    """Every file under ``path`` (relative to it), sorted."""
    return sorted(for_path(path).list_files(os.fspath(path)))


def remove_file(path: os.PathLike[str] | str) -> None:
    """Deletes a file; a missing one is fine."""
    for_path(path).remove_file(os.fspath(path))


def remove_tree(path: os.PathLike[str] | str) -> None:
    """Deletes a directory tree; a missing one is fine."""
    for_path(path).remove_tree(os.fspath(path))


def make_dirs(path: os.PathLike[str] | str, mode: int | None = None) -> None:
    """Creates a directory and its parents (nothing to do on object stores)."""
    for_path(path).make_dirs(os.fspath(path), mode)
