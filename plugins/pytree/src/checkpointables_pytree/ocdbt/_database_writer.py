"""A new OCDBT database written directly, in TensorStore's format: the plain arrays of a save.

TensorStore writes a key of an OCDBT transaction in about 7 us of Python and
C++ and copies its value (``KvStore.write`` takes ``bytes``): a save of
5,000 small arrays (10,000 keys, 41 MB) spent 114 ms in it. A save needs
the simplest case of the format (TensorStore's docs, "ocdbt Key-Value Store
driver", "Storage format", encoded by ``_ocdbt_format``): a database no one
else writes, created with one version whose values are in data files of our
own. Its keys and the sizes of their values depend only on the tree's
structure, and so does nearly everything else: which data file holds each
value and where, which values are inline in the b-tree (those of at most
``MAX_INLINE_VALUE_BYTES``, as TensorStore does), the b-tree's nodes but for
those inline values. ``DatabaseLayout`` is all that, made once per structure;
each save fills it with its values:

* data files (``d/<32 hex digits>``) of about ``file_bytes``, written from the
  arrays' own memory, each as soon as its values are known;
* a last file with the b-tree (uncompressed leaf nodes, and an interior node
  when they are more than one);
* the manifest (configuration and the single version), written last.

TensorStore and Orbax read the result as any OCDBT database, and TensorStore
commits on top of it (merges of other writers' databases).
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import hashlib
import itertools
import os
import secrets
import shutil
import stat
from collections.abc import Sequence
from typing import Any

import checkpointables as cp
import numpy as np
import tensorstore as ts
from etils import epath

from checkpointables_pytree import storage
from checkpointables_pytree.ocdbt import _context, _format

__all__ = [
    "DataFile",
    "DatabaseFiles",
    "DatabaseLayout",
    "Deferred",
    "Linked",
    "MAX_INLINE_VALUE_BYTES",
    "link_files",
    "make_directories",
]

MAX_INLINE_VALUE_BYTES = _format.MAX_INLINE_VALUE_BYTES
_IOV_MAX = 1024  # Buffers per os.writev (Linux's limit).

Buffer = Any  # bytes, a 1-D np.uint8 array, or a Deferred (giving bytes).
# A part of a file as a layout records it: fixed bytes, or the index of a variable value.
Recipe = list[bytes | int]


class Deferred:
    """A part of a value computed only when it is written: ``function(*args)`` (bytes)."""

    __slots__ = ("args", "function")

    def __init__(self, function: Any, *args: Any) -> None:
        self.function = function
        self.args = args

    def __call__(self) -> bytes:
        return self.function(*self.args)


def _resolved(parts: Sequence[Buffer]) -> list[Buffer]:
    return [p() if type(p) is Deferred else p for p in parts]


class Linked:
    """A value that is already in a data file of another database, which the new one links
    (``link_files``): ``length`` bytes at ``offset`` of ``source``, linked as ``name``
    (``linked_name``: never the name of a file the layout writes). On an object store,
    ``listed`` is the source object as the save listed it (size, ETag): what is copied."""

    __slots__ = ("length", "listed", "name", "offset", "source")

    def __init__(
        self, source: str, offset: int, length: int, listed: storage.ObjectInfo | None = None
    ) -> None:
        self.source = source
        self.offset = offset
        self.length = length
        self.listed = listed
        self.name = linked_name(source)


def linked_name(source: str) -> str:
    """The name (``d/r<hex>``) a database gives its link of the file at ``source``: a hash
    of the whole path, so that two source files never share one (a source's ``d/x`` and
    ``d/rx``, or ``d/x`` and ``e/x``: a forged b-tree may name both), and no name of a
    file the layout writes (``d/<hex>``)."""
    return "d/r" + hashlib.blake2b(source.encode(), digest_size=16).hexdigest()


def link_files(database: epath.Path, linked: Sequence[Linked]) -> None:
    """Gives the ``database`` its own copy of the source file of every ``linked`` value:
    a hard link on a local disk, a server-side copy on S3 (no byte through this host).

    A link adds a name, never data: the source's file is immutable, and deleting
    the source's checkpoint leaves this one's name. A copy is an object of the new
    checkpoint's own. Either way each checkpoint stays whole.

    Raises:
      cp.errors.StorageError: a server-side copy failed (its source gone or replaced), or
        a local source file was deleted.
      cp.errors.IntegrityError: a local source file is no longer a regular file (replaced
        since the save chose it); nothing of it is left in ``database``.
    """
    unique = list({value.name: value for value in linked}.values())
    if not _context.is_local(database):
        root = os.fspath(database).rstrip("/")
        copies = []
        for value in unique:
            if value.listed is None:
                raise ValueError(f"{value.source} was not listed: it cannot be copied.")
            copies.append(storage.ServerCopy(value.source, f"{root}/{value.name}", value.listed))
        storage.copy_objects(copies)
        return
    root = os.fspath(database).rstrip("/")
    for directory in {os.path.dirname(value.name) for value in unique}:  # Once each ("d").
        make_directories(root, directory)
    for value in unique:  # Names are relative ("d/r<hex>"): no os.path.join per file.
        target = f"{root}/{value.name}"
        try:
            os.link(value.source, target, follow_symlinks=False)
        except FileNotFoundError as e:
            raise cp.errors.StorageError(
                f"{value.source}, a data file this save reuses, was deleted during the save "
                f"(someone deleted the checkpoint it reuses from): this save is not "
                f"committed. Save again."
            ) from e
        except OSError as e:
            if e.errno not in _NO_HARD_LINK:
                raise
            _copy_instead(value.source, target, e)
        _check_linked(value.source, target)


# A file system that cannot link this file here: another file system (a save's
# checkpoint moved or mounted elsewhere), none at all (some network and FUSE file
# systems), or a file at its link limit (ext4: 65,000 names).
_NO_HARD_LINK = frozenset({errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP})


def _copy_instead(source: str, target: str, why: OSError) -> None:
    """Copies ``source`` to ``target``, flushed, where it cannot be hard-linked (said once
    in the log): the checkpoint is the same, at the cost of the file's bytes."""
    cp.reuse.log_once(
        f"no-link:{why.errno}",
        f"Cannot hard-link {source} ({why.strerror}): reused files are copied instead "
        f"(in the kernel: their bytes are written again, not sent through Python).",
    )
    try:  # sendfile on Linux: in the kernel. A symbolic link is copied as one, not followed.
        shutil.copyfile(source, target, follow_symlinks=False)
    except (shutil.SpecialFileError, IsADirectoryError) as e:  # A pipe, a directory.
        raise _replaced(source, "a pipe, a device or a directory") from e
    fd = os.open(target, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_linked(source: str, target: str) -> None:
    """Removes ``target`` and fails the save if what it names is no regular file: the
    source's file, found regular when the save chose it, was replaced since (by a
    symbolic link, say, which the new checkpoint must not hold)."""
    mode = os.lstat(target).st_mode
    if not stat.S_ISREG(mode):
        os.unlink(target)
        raise _replaced(source, "a symbolic link" if stat.S_ISLNK(mode) else "no regular file")


def _replaced(source: str, kind: str) -> cp.errors.IntegrityError:
    return cp.errors.IntegrityError(
        f"{source}, a data file this save reuses, became {kind} during the save: nothing "
        f"was taken from it, and this save is not committed. Someone is writing into the "
        f"checkpoint it reuses from; save again, reusing from storage no one else writes."
    )


class DataFile:
    """A file to write: ``name`` (``d/<hex>``, relative to the database) and its parts."""

    __slots__ = ("name", "parts")

    def __init__(self, name: str, parts: list[Buffer]) -> None:
        self.name = name
        self.parts = parts


class DatabaseLayout:
    """Where each value of a new database goes, and its b-tree, for given keys and value
    sizes: made once, filled with the values of each database written.

    A value is *fixed* (the same in every database of this layout, given here:
    an array's ``zarr.json``) or *variable* (given to ``data_file`` and
    ``btree_file`` as a sequence of parts, in the order of the variable keys:
    an array's chunks). Data files hold about ``file_bytes``; if
    ``first_file_bytes`` is given, the first holds that much and each next one
    twice the previous (the disk starts early; a large database has few files).

    Example::

        layout = DatabaseLayout(["w/zarr.json", "w/c/0"], [len(text), n], [text, None])
        names = layout.file_names()
        values = [[chunk]]  # Values 0 to layout.needs(k) - 1 are enough to write file k.
        files = [layout.data_file(k, names, values) for k in range(layout.data_files)]
        btree, manifest = layout.btree_file(names, values)
        # Write the files and btree, then the manifest as manifest.ocdbt.

    Raises:
      ValueError: a key is given twice.
    """

    def __init__(
        self,
        keys: Sequence[str],
        lengths: Sequence[int],
        fixed: Sequence[bytes | Linked | None],
        *,
        file_bytes: int,
        first_file_bytes: int | None = None,
        max_node_bytes: int = _format.MAX_NODE_BYTES,
        breaks: frozenset[int] = frozenset(),
    ) -> None:
        variable = itertools.count()
        values = [next(variable) if f is None else f for f in fixed]
        self._breaks = breaks
        # Linked files by name -> their place after the b-tree's file in the table.
        linked = dict.fromkeys(f.name for f in fixed if type(f) is Linked)
        self._linked = {name: 1 + i for i, name in enumerate(linked)}
        self._base = "d/" + secrets.token_hex(12)
        places = self._place(values, lengths, file_bytes, first_file_bytes or file_bytes)
        # The b-tree's file: the last; its name's place in the table is the same each time.
        self.data_files = len(self._files)
        places = [
            (self.data_files + p[1], p[2]) if type(p) is tuple and p[0] == "linked" else p
            for p in places
        ]
        names = [name.encode() for name in self.file_names()]
        self._table_bytes = len(_format.file_table(names))
        self._leaves, self._root = self._btree(
            [k.encode() for k in keys], lengths, places, max_node_bytes
        )

    def _place(self, values: list[Any], lengths: Sequence[int], most: int, limit: int) -> list[Any]:
        """Puts each value inline or into a data file; returns where each went."""
        self._files: list[Recipe] = []
        self._needs: list[int] = []  # Per data file: how many variable values it needs.
        places: list[Any] = []
        used = 0
        for position, (value, length) in enumerate(zip(values, lengths, strict=True)):
            if type(value) is Linked:  # In a linked file, after the b-tree's in the table.
                places.append(("linked", self._linked[value.name], value.offset))
                continue
            if length <= MAX_INLINE_VALUE_BYTES:
                places.append(value)
                continue
            if not self._files or (used and (used + length > limit or position in self._breaks)):
                if self._files:
                    limit = min(2 * limit, most)
                self._files.append([])
                self._needs.append(self._needs[-1] if self._needs else 0)
                used = 0
            places.append((len(self._files) - 1, used))
            self._files[-1].append(value)
            used += length
            if type(value) is int:
                self._needs[-1] = value + 1
        return places

    def _btree(
        self,
        keys: list[bytes],
        lengths: Sequence[int],
        places: list[Any],
        max_node_bytes: int,
    ) -> tuple[list[Recipe], tuple[bytes | None, int, int, int, list[int]]]:
        """The leaves (their parts after the file table) and the root: its interior node
        (``None`` if the only leaf is the root), offset, length, height and statistics."""
        if len(set(keys)) != len(keys):
            raise ValueError("An OCDBT database cannot hold a key twice.")
        order = sorted(range(len(keys)), key=keys.__getitem__)
        keys = [keys[i] for i in order]
        lengths = [lengths[i] for i in order]
        places = [places[i] for i in order]
        indirect = np.array([type(p) is tuple for p in places])
        inline_bytes = np.where(indirect, 0, np.asarray(lengths, np.int64))
        fixed_bytes = 1 + self._table_bytes  # The height, the file table.
        budget = max_node_bytes - fixed_bytes - 64  # 64: the node's header and counts.
        leaves, sizes, counts, indirect_bytes = [], [], [], []
        for begin, end in _format.leaf_ranges(keys, inline_bytes, budget):
            body = _format.leaf_body(keys[begin:end], lengths[begin:end], places[begin:end])
            leaves.append(_joined_runs(body))
            # Its bytes: the encoding and fixed values, then the variable values inline.
            variable = zip(places[begin:end], lengths[begin:end], strict=True)
            body_bytes = sum(len(p) for p in body if type(p) is bytes)
            body_bytes += sum(n for p, n in variable if type(p) is int)
            sizes.append(_format.framed_size(fixed_bytes + body_bytes))
            counts.append(end - begin)
            lengths_in_files = np.asarray(lengths[begin:end], np.int64)[indirect[begin:end]]
            indirect_bytes.append(int(lengths_in_files.sum()))
        if len(leaves) == 1:
            return leaves, (None, 0, sizes[0], 0, [counts[0], sizes[0], indirect_bytes[0]])
        first_keys = [keys[begin] for begin in itertools.accumulate([0, *counts[:-1]])]
        root = _format.interior_body(
            first_keys, sizes, counts, indirect_bytes, (self.data_files, 0)
        )
        length = _format.framed_size(fixed_bytes + len(root))
        statistics = [len(keys), sum(sizes) + length, sum(indirect_bytes)]
        return leaves, (root, sum(sizes), length, 1, statistics)

    def file_names(self) -> list[str]:
        """New names for the files (the data files, then the b-tree's, then the linked
        ones): random, and each (relative to the others) as in every database of this
        layout, so that the file table has the same length. (A linked name starts
        ``d/r``: its common prefix with the b-tree's is always ``d/``.)"""
        base = "d/" + secrets.token_hex(12) if not self._linked else self._base
        return [f"{base}{k:08x}" for k in range(self.data_files + 1)] + list(self._linked)

    def needs(self, data_file: int) -> int:
        """How many variable values the data file ``data_file`` needs (the first ones)."""
        return self._needs[data_file]

    def data_file(
        self, data_file: int, names: Sequence[str], values: Sequence[Sequence[Buffer]]
    ) -> DataFile:
        """The data file ``data_file``, of ``names`` (``file_names``), with ``values``."""
        return DataFile(names[data_file], _filled(self._files[data_file], values))

    def btree_file(
        self, names: Sequence[str], values: Sequence[Sequence[Buffer]]
    ) -> tuple[DataFile, bytes]:
        """The b-tree's file (the last of ``names``) with ``values`` (inline ones are bytes
        or arrays, never ``Deferred``), and the manifest's bytes."""
        table = _format.file_table([name.encode() for name in names])
        magic = _format.BTREE_NODE_MAGIC
        parts: list[Buffer] = []
        for recipe in self._leaves:
            parts += _format.framed(magic, [b"\x00", table, *_filled(recipe, values)])
        root, offset, length, height, statistics = self._root
        if root is not None:
            parts += _format.framed(magic, [b"\x01", table, root])
        btree_name = names[self.data_files]
        manifest = _format.manifest(btree_name, offset, length, height, statistics)
        return DataFile(btree_name, parts), manifest


def _joined_runs(parts: Sequence[bytes | int]) -> Recipe:
    """``parts`` with each run of fixed bytes joined into one."""
    recipe: Recipe = []
    for fixed, run in itertools.groupby(parts, key=lambda part: type(part) is bytes):
        runs = list(run)
        recipe.extend([b"".join(runs)] if fixed else runs)  # type: ignore[arg-type]
    return recipe


def _filled(recipe: Recipe, values: Sequence[Sequence[Buffer]]) -> list[Buffer]:
    """The parts of ``recipe``, each variable value's parts in its place."""
    parts: list[Buffer] = []
    for part in recipe:
        if type(part) is int:
            parts.extend(values[part])
        else:
            parts.append(part)
    return parts


class DatabaseFiles:
    """Writes the files of a new database: with ``os.writev`` from the arrays' own memory on
    a local disk, through TensorStore's kvstore on an object store (one PUT per file; a
    large one, which only an incremental save makes, in parts: ``storage.upload_in_parts``)."""

    def __init__(self, database: epath.Path, store: ts.KvStore | None) -> None:
        self._database = database
        self._store = store

    @classmethod
    async def open(cls, database: epath.Path, context: ts.Context) -> DatabaseFiles:
        """The files of ``database``."""
        if _context.is_local(database):
            return cls(database, None)
        spec = _context.location_spec(database)
        return cls(database, await ts.KvStore.open(spec, context=context))

    @property
    def local(self) -> bool:
        """Whether the database is on a local disk."""
        return self._store is None

    def start(self, file: DataFile, *, flush: bool) -> asyncio.Future[None]:
        """Starts writing ``file`` (a new one) now, on a thread; on a local disk, fsyncs it
        if ``flush``. The caller may go on encoding: the write does not wait for the event
        loop to run. A large remote file is uploaded in parts (``storage.upload_in_parts``)."""
        loop = asyncio.get_running_loop()
        if self._store is None:
            directory = os.fspath(self._database)
            return loop.run_in_executor(None, write_local_file, directory, file, flush)
        url = self._url(file)
        if storage.uploaded_in_parts(url, _known_bytes(file)):
            parts = file.parts
            # Under the save's context: its storage options (endpoint, credentials, retries).
            context = contextvars.copy_context()
            return loop.run_in_executor(
                None, context.run, lambda: storage.upload_in_parts(url, _resolved(parts))
            )
        return asyncio.ensure_future(_put(self._store, file))

    def held_bytes(self, file: DataFile) -> int:
        """The most host memory writing ``file`` holds besides the arrays' own: nothing on a
        local disk, two copies of a remote file PUT whole, a few parts of a large one."""
        if self._store is None:
            return 0
        nbytes = _known_bytes(file)
        if storage.uploaded_in_parts(self._url(file), nbytes):
            return min(nbytes, storage.UPLOAD_HELD_BYTES)
        return 2 * nbytes

    def _url(self, file: DataFile) -> str:
        return f"{os.fspath(self._database).rstrip('/')}/{file.name}"


def _known_bytes(file: DataFile) -> int:
    """The bytes of ``file`` but its ``Deferred`` parts (a few bytes each)."""
    return sum(memoryview(p).nbytes for p in file.parts if type(p) is not Deferred)


async def _put(store: ts.KvStore, file: DataFile) -> None:
    """PUTs ``file`` as one value (a joined copy, dropped once TensorStore has its own)."""
    joined = await asyncio.to_thread(lambda: b"".join(_resolved(file.parts)))
    put = store.write(file.name, joined)
    del joined  # TensorStore has its own copy.
    await put


def write_local_file(directory: str, file: DataFile, flush: bool) -> None:
    """Writes ``file`` under the local database ``directory`` (then fsyncs it if ``flush``).

    Raises:
      cp.errors.StorageError: ``directory`` vanished during the save (``make_directories``).
    """
    path = os.path.join(directory, file.name)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:  # The first file of its directory (once per save).
        make_directories(directory, os.path.dirname(file.name))
        try:
            fd = os.open(path, flags, 0o644)
        except FileNotFoundError as e:
            raise vanished(os.path.dirname(path)) from e
    try:
        _write_all(fd, file.parts)
        if flush:
            os.fsync(fd)
    finally:
        os.close(fd)


def make_directories(database: str, relative: str = "") -> None:
    """Makes the local ``database`` directory and ``relative`` below it (``"d"``) where
    missing, one level at a time: never the directories above ``database``.

    A save writes into directories that exist (its temporary directory, made by the
    commit's protocol) or that it makes below them. Making their parents again
    (``os.makedirs``) would quietly recreate a directory someone deleted during the
    save, and the commit would then rename a few recreated files into a step that
    looks finished and cannot be loaded.

    Raises:
      cp.errors.StorageError: the directory above ``database`` vanished, naming it.
    """
    path = database.rstrip("/")
    for name in [None, *filter(None, relative.split("/"))]:
        path = path if name is None else f"{path}/{name}"
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        except FileNotFoundError as e:
            raise vanished(os.path.dirname(path)) from e


def vanished(directory: str) -> cp.errors.StorageError:
    """The error of a save whose ``directory`` was deleted while it wrote."""
    return cp.errors.StorageError(
        f"{directory}, a directory this save writes into, vanished during the save (someone "
        f"deleted it, or the save's temporary directory above it): this save is not "
        f"committed. Save again, and let no one else delete the checkpoint's directory "
        f"while it is written."
    )


def _write_all(fd: int, parts: Sequence[Buffer]) -> None:
    """``os.writev`` of every part, resuming after short writes.

    The common case is a few calls and no Python per part: a thread that writes
    while the event loop's thread encodes must hold the GIL as little as possible.
    """
    parts = _resolved(parts)
    for begin in range(0, len(parts), _IOV_MAX):
        group = parts[begin : begin + _IOV_MAX]
        written = os.writev(fd, group)
        if written != sum(map(len, group)):  # len: bytes, or 1-D uint8 arrays.
            write_rest(fd, group, written)


def write_rest(fd: int, parts: Sequence[Buffer], written: int) -> None:
    """Writes what a short ``os.writev`` of ``parts`` left (``written`` bytes were)."""
    views = [memoryview(p).cast("B") for p in parts]
    start = 0
    while True:
        while start < len(views) and written >= len(views[start]):
            written -= len(views[start])
            start += 1
        if start == len(views):
            return
        views[start] = views[start][written:]
        written = os.writev(fd, views[start:])
