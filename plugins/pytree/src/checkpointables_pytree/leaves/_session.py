"""State one save or load shares between the standard leaf handlers.

``PyTreeHandler`` creates a session and hands it to the leaf handlers inside
its ``SerializationContext`` / ``DeserializationContext`` (subclasses that add
a ``session`` field; custom leaf handlers see the ordinary fields). Leaf
handlers only *schedule* array I/O on the session in their blocking phase;
the handler then runs all of it at once, so thousands of small arrays cost
a few transactions rather than thousands of driver opens.

A standard leaf handler called without a session (directly, by other code)
makes a private one and runs it inside its own awaitable.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import checkpointables as cp
import crc32c
import jax
import numpy as np
from etils import epath

from checkpointables_pytree import io, ocdbt, storage, zarr3
from checkpointables_pytree import tree as tree_room
from checkpointables_pytree.io import StoredArray, Writer, chunk_keys
from checkpointables_pytree.leaves._options import ArrayOptions

__all__ = [
    "NamedSerializationParam",
    "NamedDeserializationParam",
    "SaveSession",
    "LoadSession",
    "PyTreeSerializationContext",
    "PyTreeDeserializationContext",
    "STRINGS_FILE",
    "ARRAY_METADATAS_DIR",
]

STRINGS_FILE = "_strings.json"
ARRAY_METADATAS_DIR = "array_metadatas"


@dataclasses.dataclass
class SaveSession:
    """What the standard leaf handlers collect during one save."""

    directory: cp.path.PathAwaitingCreation
    context: cp.Context
    caller_waits: bool
    writer: Writer
    strings: dict[str, str] = dataclasses.field(default_factory=dict)
    shardings: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    array_metadatas: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # Per storage name: Orbax's write_shape, and our extra value metadata.
    write_shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    extras: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # Looked up once per save rather than once per leaf.
    primary: bool = True
    compression: bool = False
    array_options: ArrayOptions = dataclasses.field(default_factory=ArrayOptions)
    # Work the leaf handlers left for the background phase (``defer``), done by ``plan``.
    deferred: list[Callable[[], None]] = dataclasses.field(default_factory=list)

    @classmethod
    def create(
        cls,
        directory: cp.path.PathAwaitingCreation,
        context: cp.Context,
        structure_cache: dict[Any, Any] | None = None,
    ) -> SaveSession:
        """A session for a save into ``directory`` under ``context``; the writer keeps what
        depends only on the tree's structure in ``structure_cache``."""
        from checkpointables.execution import caller_waits

        return cls(
            directory=directory,
            context=context,
            caller_waits=caller_waits(),
            writer=Writer(
                directory,
                structure_cache,
                fast_path=context.array_options.ocdbt_fast_path,
                host_bytes=context.memory_options.host_bytes,
            ),
            primary=cp.multihost.is_primary_host(context),
            compression=bool(context.array_options.use_compression),
            array_options=context.array_options,
        )

    def defer(self, work: Callable[[], None]) -> None:
        """Leaves ``work`` (recording layouts and metadata of snapshotted leaves) for ``plan``.

        The caller of an asynchronous save waits only for the snapshot of the
        values; what depends only on the tree's structure is done after it
        got control back.
        """
        self.deferred.append(work)

    def plan(self) -> None:
        """Does the deferred work; before the writer runs and the metadata is written."""
        deferred, self.deferred = self.deferred, []
        for work in deferred:
            work()

    def strings_text(self) -> str:
        """The text of ``_strings.json``.

        Raises:
          cp.errors.InvalidArgumentError: it would hold more than a metadata file may
            (``cp.metadata_checksums.MAX_FILE_BYTES``), which a load refuses.
        """
        text = json.dumps(self.strings, ensure_ascii=False)
        limit = cp.metadata_checksums.MAX_FILE_BYTES
        if len(text) > limit // 4 and len(text.encode()) > limit:  # Cheap while far below.
            raise cp.errors.InvalidArgumentError(
                f"The string leaves of this pytree hold more than {limit:,} bytes, more than a "
                f"checkpoint's metadata file may hold. Store large text as arrays (e.g. "
                f"np.frombuffer(text.encode(), np.uint8)) or bytes leaves."
            )
        return text

    async def run(self, *, write_files: bool) -> None:
        """Writes the arrays and (if ``write_files``) the strings and sharding files.

        The files are written while TensorStore commits the arrays.
        """
        self.plan()
        arrays = asyncio.ensure_future(self.writer.run())
        try:
            if write_files and (self.strings or self.shardings or self.array_metadatas):
                self.write_files(await self.directory.await_creation())
        finally:
            await arrays

    def write_files(self, directory: epath.Path) -> None:
        """Writes ``_strings.json``, ``_sharding`` and ``array_metadatas/process_<i>``."""
        primary = cp.multihost.is_primary_host(self.context)
        if self.strings and primary:
            write_text(directory / STRINGS_FILE, self.strings_text())
        if self.shardings and primary:
            tree_room.write_sharding_file(directory, self.shardings)
        if self.array_metadatas:
            cp.storage.make_dirs(directory / ARRAY_METADATAS_DIR)
            write_text(
                directory / ARRAY_METADATAS_DIR / f"process_{cp.multihost.process_index()}",
                json.dumps(
                    {"array_metadatas": [{"array_metadata": m} for m in self.array_metadatas]}
                ),
            )


def write_text(path: epath.Path, text: str) -> None:
    """Writes a small file. Not flushed here: the commit fsyncs every file of the checkpoint."""
    cp.storage.write_text(path, text)


@dataclasses.dataclass(frozen=True)
class NamedSerializationParam(cp.serialization.SerializationParam[Any]):
    """A ``SerializationParam`` whose storage name was computed once, by ``PyTreeHandler``."""

    storage_name: str = ""

    @property
    def name(self) -> str:
        """The storage name (escaped key path)."""
        return self.storage_name


@dataclasses.dataclass(frozen=True)
class NamedDeserializationParam(cp.serialization.DeserializationParam[Any]):
    """A ``DeserializationParam`` that also carries its key names, known to ``PyTreeHandler``."""

    names: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class PyTreeSerializationContext(cp.serialization.SerializationContext):
    """A ``SerializationContext`` carrying the save's shared session."""

    session: SaveSession | None = None


@dataclasses.dataclass(frozen=True)
class PyTreeDeserializationContext(cp.serialization.DeserializationContext):
    """A ``DeserializationContext`` carrying the load's shared session."""

    session: LoadSession | None = None


_UNKNOWN = object()  # Not looked up yet.


class Leaf(NamedTuple):
    """What a load needs of a recorded leaf (``LoadSession.leaf``)."""

    entry: tree_room.Entry
    name: str  # Of its array in the database.
    stored: StoredArray | None  # Its recorded layout, if any.
    keys: tuple[bytes, ...] | None  # Of its shards in the database (``None``: not known yet).


class LoadSession:
    """What the standard leaf handlers share during one load (or metadata read)."""

    def __init__(
        self,
        directory: epath.Path,
        tree: tree_room.TreeMetadata,
        context: cp.Context,
        opened: ocdbt.OpenedDatabase | None = None,
        index: ocdbt.DatabaseIndex | None = None,
    ) -> None:
        self.directory = directory
        self.tree = tree
        self.context = context
        self.allow_resize = bool(context.array_options.enable_padding_and_truncation)
        self.reader = io.Reader(
            directory,
            ocdbt=tree.use_ocdbt,
            zarr3=tree.use_zarr3,
            verify=bool(context.array_options.verify_checksums),
            opened=opened,
            # Layouts recorded in an unchecksummed _METADATA (written by an earlier version)
            # must agree with the arrays' own zarr.json.
            cross_check=not tree.checksum_recorded,
            fast_path=context.array_options.ocdbt_fast_path,
            index=index,
            host_bytes=context.memory_options.host_bytes,
        )
        # Derived from the _METADATA text alone: shared by the loads of one structure.
        derived = tree.derived
        self.entries = tree_room.entries_by_names(tree)
        self._names: dict[tuple[str, ...], str] = derived.setdefault("storage_names", {})
        self._direct_layout = bool(tree.use_ocdbt and tree.use_zarr3)
        self._stored: dict[tuple[str, ...], StoredArray | None] = derived.setdefault("stored", {})
        self._leaves: dict[tuple[str, ...], Leaf] = derived.setdefault("leaves", {})
        self._strings: dict[str, Any] | None = None
        self._shardings: dict[str, dict[str, Any]] | None = None
        self._zarr_metadata: dict[str, dict[str, Any]] = {}
        # Key paths of arrays saved over more devices than this process has that the abstract
        # tree gives no sharding: they load whole onto the default device (the load warns).
        self.unplaced: list[str] = []

    def info(
        self, keypath: Sequence[Any], names: tuple[str, ...] | None = None
    ) -> tuple[tree_room.Entry, str]:
        """A leaf's recorded entry and storage name (``names``: its key names, if known)."""
        if names is None:
            names = tree_room.key_names(keypath)
        name = self._names.get(names)
        if name is None:
            name = self._names[names] = self.tree.storage_name(names)
        return self.entries[names], name

    def leaf(self, keypath: Sequence[Any], names: tuple[str, ...] | None = None) -> Leaf:
        """A leaf's entry, storage name and recorded layout, in one look-up (``names``: its
        key names, if known); what a load of many small arrays asks of each leaf."""
        if names is None:
            names = tree_room.key_names(keypath)
        leaf = self._leaves.get(names)
        if leaf is None:
            entry, name = self.info(keypath, names)
            stored = self.stored_array(entry)
            # The keys of a one-shard array, kept (those of larger ones are made when read).
            keys = chunk_keys(name, stored) if stored is not None and stored.single_chunk else None
            leaf = self._leaves[names] = Leaf(entry, name, stored, keys)
        return leaf

    def entry(self, keypath: Sequence[Any]) -> tree_room.Entry:
        """The recorded entry of a leaf."""
        return self.entries[tree_room.key_names(keypath)]

    def storage_name(self, keypath: Sequence[Any]) -> str:
        """The name a leaf's array is stored under."""
        return self.tree.storage_name(tree_room.key_names(keypath))

    def stored_array(self, entry: tree_room.Entry) -> StoredArray | None:
        """The layout this library recorded for an array leaf, or ``None``."""
        stored = self._stored.get(entry.names, _UNKNOWN)
        if stored is _UNKNOWN:
            stored = self._stored[entry.names] = self._stored_array(entry)
        return stored  # type: ignore[return-value]

    def _stored_array(self, entry: tree_room.Entry) -> StoredArray | None:
        extra = entry.extra
        try:
            dtype_name = extra["dtype"]
            recorded_shape = extra["shape"]
        except KeyError:
            return None
        dtype = _dtype(dtype_name) if type(dtype_name) is str else None
        if dtype is None:
            return None
        shape = self._dimensions(entry, "shape", recorded_shape, 0)
        chunks = extra.get("chunk_shape")
        if chunks is None:
            chunk_shape = zarr3.default_chunk_shape(shape)
        elif chunks == recorded_shape:  # The usual small array: one chunk.
            chunk_shape = shape
        else:
            chunk_shape = self._dimensions(entry, "chunk_shape", chunks, 1)
            if len(chunk_shape) != len(shape):
                raise self._malformed(entry, "its chunk shape and shape differ in rank")
        # Checkpoints written before this library checked zarr3's CRC-32C record checksums
        # of their own ("crc32", "sums_crc32"): not needed, every shard carries its CRC-32C.
        return StoredArray(
            shape, dtype, chunk_shape, self._direct_layout and bool(extra.get("one_chunk_shards"))
        )

    def _malformed(self, entry: tree_room.Entry, problem: str) -> cp.errors.MetadataError:
        return cp.errors.MetadataError(
            f"{self.directory / tree_room.METADATA_FILE} is malformed: {entry.keystr}: "
            f"{problem}. The pytree's metadata is damaged; restore the checkpoint from a copy."
        )

    def _dimensions(
        self, entry: tree_room.Entry, field: str, recorded: Any, least: int
    ) -> tuple[int, ...]:
        """A recorded shape: a list of integers of at least ``least``, else an error."""
        # C-level checks only: a load of many small arrays makes this call for each.
        if (
            type(recorded) is list
            and all(map(_IS_INT, recorded))
            and (not recorded or min(recorded) >= least)
        ):
            return tuple(recorded)
        raise self._malformed(entry, f"its {field} is not a list of integers >= {least}")

    # -- Files read lazily -------------------------------------------------------

    def strings(self) -> dict[str, Any]:
        """The contents of ``_strings.json`` (checked against its recorded checksum)."""
        if self._strings is None:
            path = self.directory / STRINGS_FILE
            try:
                raw = cp.metadata_checksums.read_file(
                    path, max_bytes=cp.metadata_checksums.MAX_FILE_BYTES
                )
            except FileNotFoundError:
                raise storage.integrity_error(
                    f"{path}", "the file holding the tree's string leaves is missing"
                ) from None
            expected = self.tree.strings_crc32c
            if expected is not None and crc32c.crc32c(raw) != expected:
                raise storage.integrity_error(f"{path}", "its CRC-32C checksum does not match")
            self._strings = cp.safe_json.loads_object(raw, source=path)
        return self._strings

    def sharding_record(self, storage_name: str) -> dict[str, Any] | None:
        """The recorded sharding of a ``jax.Array`` leaf, if any."""
        if self._shardings is None:
            self._shardings = tree_room.read_sharding_file(self.directory)
        return self._shardings.get(tree_room.file_key(storage_name))

    def note_unplaced(self, names: Sequence[str], labels: Sequence[Any]) -> None:
        """Notes, of arrays (storage ``names``, errors' ``labels``) whose abstract leaves have
        no sharding, those saved sharded over more devices than this process has."""
        try:
            records = [self.sharding_record(name) for name in names]
        except cp.errors.CheckpointError:
            return  # A damaged _sharding file: the load does not need it, nor does this note.
        devices = jax.device_count()
        for label, record in zip(labels, records, strict=True):
            if tree_room.device_count(record) > devices:
                self.unplaced.append(str(getattr(label, "keystr", label)))

    async def zarr_metadata(self, names: Sequence[str]) -> dict[str, dict[str, Any]]:
        """``zarr.json`` (v3) or ``.zarray`` (v2) of arrays with no recorded layout, in a batch."""
        wanted = [n for n in dict.fromkeys(names) if n not in self._zarr_metadata]
        if wanted:
            file = "zarr.json" if self.tree.use_zarr3 else ".zarray"
            if self.tree.use_ocdbt:
                # Before TensorStore reads the manifest and the root node whole (a local
                # database's open checks them itself; on an object store: two GETs).
                ocdbt.check_manifest(self.directory)
                kvstore = await ocdbt.open_kvstore(self.directory, ocdbt.make_context())
                futures = [kvstore.read(f"{n}/{file}") for n in wanted]
                try:
                    values = [(await f).value for f in futures]
                except ValueError as e:  # TensorStore's: a node or data file is unreadable.
                    what = f"the {file} of arrays in {self.directory}"
                    raise storage.storage_error(what, e) from None
            else:
                values = []
                for n in wanted:
                    try:
                        directory = storage.array_directory(self.directory, n)
                        values.append(cp.storage.read_bytes(directory / file))
                    except FileNotFoundError:
                        values.append(b"")
            for name, value in zip(wanted, values, strict=True):
                if not value:
                    raise storage.integrity_error(f"array {name!r}", f"its {file} is missing")
                self._zarr_metadata[name] = cp.safe_json.loads_object(
                    value, source=f"the {file} of array {name!r} in {self.directory}"
                )
        return {n: self._zarr_metadata[n] for n in names}


_IS_INT = int.__instancecheck__


@functools.lru_cache(maxsize=256)  # Bounded: the names come from the checkpoint.
def _dtype(name: str) -> np.dtype | None:
    """The dtype recorded as ``name``, if zarr3 can store it (else the driver decides)."""
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError):  # Not a dtype, or one NumPy refuses (a huge subarray).
        return None
    return dtype if zarr3.zarr_dtype_name(dtype) == name else None
