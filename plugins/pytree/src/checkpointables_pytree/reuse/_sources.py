"""Where the source holds the chunks a save may link, checked against its files.

``Source`` reads the source's b-tree (``ocdbt.DatabaseIndex``: started as soon
as the save knows its source, on the index's worker thread, while the arrays
are fingerprinted) and checks each data file it names once: a local file's
size (one ``stat``), or on S3 the object as listed (size and ETag; one LIST per
directory of data files) against the record of the save that wrote it. A
chunk is linkable only if its file is there with at least the bytes the
b-tree names. Local files are looked at by every save. A step on an object
store reads its b-tree back, and lists its data objects, after its commit for
the next save (``_prefetched``), whose ``Source`` then lists none of those
directories (the objects are listed again before they are copied).
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Collection, Sequence
from typing import Any

import checkpointables as cp
from etils import epath

from checkpointables_pytree import ocdbt, storage

__all__ = ["Source", "data_directories"]


class Source:
    """The data files of a source checkpoint's database, as its b-tree places chunks."""

    def __init__(
        self,
        source: epath.Path,
        recorded_files: dict[str, Any] | None,
        index: ocdbt.DatabaseIndex | None = None,
        listed: dict[str, storage.ObjectInfo] | None = None,
        listed_directories: frozenset[str] = frozenset(),
    ) -> None:
        """Starts reading the b-tree of ``source`` (a pytree directory) in the background
        (``index``: its b-tree, with some nodes read already; ``listed``: the objects of the
        data directories ``listed_directories``, listed then: ``_prefetched``).

        ``recorded_files``: ``"d/<name>" -> [size, ETag]`` on S3, ``[size, mtime in ns]``
        on a local disk, as the source's save recorded them (its ``_REUSE.json``): a file
        that no longer matches, or is not listed, is not linked. ``None`` (a source
        without a record, whose stored bytes are compared): sizes only, locally.
        """
        self._local = ocdbt.is_local(source)
        self._root = os.fspath(ocdbt.database_directory(source)).rstrip("/") + "/"
        self._recorded = recorded_files
        self._index = index or ocdbt.DatabaseIndex(source)
        self._listed_directories = listed_directories
        self._index.prefetch()  # The manifest and the root node, on the index's thread.
        self.listed: dict[str, storage.ObjectInfo] = dict(listed or {})
        # The values of ``keys`` that the b-tree holds inline (an array's ``zarr.json``).
        self.inline: dict[str, bytes] = {}

    async def locate(self, keys: Collection[str]) -> dict[str, ocdbt.ValueLocation]:
        """The chunks of ``keys`` that are in data files there with at least the bytes the
        b-tree names (``{}``: a damaged source, whose data is then written afresh). Values
        stored inline in the b-tree (small ones: a ``zarr.json``) go to ``inline``."""
        if not keys:
            return {}
        try:
            found = await self._index.find(keys)
        except (OSError, ValueError, cp.errors.IntegrityError):
            return {}
        places = {}
        for key, value in found.items():
            if isinstance(value, ocdbt.ValueLocation):
                places[key.decode()] = value
            else:
                self.inline[key.decode()] = bytes(value)
        return await asyncio.to_thread(self._present, places)

    def small_value(self, key: str, place: ocdbt.ValueLocation | None, most: int) -> bytes | None:
        """The value of ``key``: inline in the b-tree, or (a local file) read from ``place``
        if it holds at most ``most`` bytes. ``None``: missing, larger, or on S3 out of line
        (a request more per array; this library's saves keep such values inline)."""
        value = self.inline.get(key)
        if value is not None or place is None or not self._local or place.length > most:
            return value
        try:
            fd = os.open(place.file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return None
        try:
            value = os.pread(fd, place.length, place.offset)
        except OSError:
            return None
        finally:
            os.close(fd)
        return value if len(value) == place.length else None

    def _present(self, found: dict[str, ocdbt.ValueLocation]) -> dict[str, ocdbt.ValueLocation]:
        """The entries of ``found`` whose file holds their bytes (each file looked at once)."""
        if not self._local:
            for directory in sorted(data_directories(found.values()) - self._listed_directories):
                self.listed.update(storage.list_objects(directory))
        sizes: dict[str, int] = {}
        present = {}
        for key, place in found.items():
            size = sizes.get(place.file)
            if size is None:
                size = sizes[place.file] = self._size(place.file)
            if size >= place.offset + place.length:
                present[key] = place
        return present

    def _size(self, file: str) -> int:
        """The file's size (-1: missing, not a regular file, or a file or an object other
        than the one recorded)."""
        recorded = None
        if self._recorded is not None:
            recorded = self._recorded.get(file.removeprefix(self._root))
        if not self._local:
            found = self.listed.get(file)
            if found is None or recorded != [found.size, found.etag]:
                return -1
            return int(found.size)
        try:
            status = os.lstat(file)
        except OSError:
            return -1
        # A regular file only: a symbolic link would be linked as one (and may lead out of
        # the source), a directory or a pipe cannot be.
        if not stat.S_ISREG(status.st_mode):
            return -1
        if self._recorded is not None and recorded != [status.st_size, status.st_mtime_ns]:
            return -1  # Written into, or replaced, since its save: not what it recorded.
        return status.st_size

    def linked(self, keys: Sequence[str], places: dict[str, ocdbt.ValueLocation]) -> list[Any]:
        """``(key, ocdbt.Linked)`` for each of ``keys`` (all in ``places``)."""
        out = []
        for key in keys:
            p = places[key]
            out.append((key, ocdbt.Linked(p.file, p.offset, p.length, self.listed.get(p.file))))
        return out


def data_directories(values: Collection[Any]) -> frozenset[str]:
    """The directories of the data files that the b-tree's ``values`` lie in (those it
    holds inline: none), each listed once on S3."""
    places = [v for v in values if isinstance(v, ocdbt.ValueLocation)]
    return frozenset(p.file.rpartition("/")[0] for p in places)
