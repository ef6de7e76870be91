"""The OCDBT database of one pytree directory: TensorStore context, kvstore specs, merging.

Every array of a pytree is a set of keys (``<name>/zarr.json``, ``<name>/c/...``)
of one OCDBT key-value database in the pytree's directory, as Orbax lays it
out. This module says how to reach it: the TensorStore context one save or
load shares (so every handle shares its caches and its writer), the spec of
the database on the local filesystem or an object store, which database this
process writes, and how databases are merged into one without copying data
(multi-process saves, several writers, partial saves).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import attrs
import checkpointables as cp
import tensorstore as ts
from etils import epath

from checkpointables_pytree import storage

__all__ = [
    "MANIFEST_FILE",
    "MAX_MANIFEST_BYTES",
    "Source",
    "check_manifest_size",
    "database_directory",
    "flush_data_files",
    "is_local",
    "kvstore_spec",
    "location_spec",
    "make_context",
    "open_location",
    "merge_into",
    "open_kvstore",
]

MANIFEST_FILE = "manifest.ocdbt"
# A manifest holds the database's configuration and its latest versions (TensorStore
# moves older ones into version-tree nodes): a few KiB. TensorStore reads it whole into
# memory whenever it opens the database, so a larger one is refused before that.
MAX_MANIFEST_BYTES = 64 << 20
# Values above this size go to data files; smaller ones sit in the b-tree's leaves.
OCDBT_CONFIG = {"max_inline_value_bytes": 1024, "max_decoded_node_bytes": 100_000_000}
# B-tree nodes are read by every key lookup of a load: cached.
OCDBT_CACHE_BYTES = 100_000_000
# A save's commits only re-read the nodes they change. With the load's cache, a save
# of 40,000 small arrays (147 MB) peaked 60 to 90 MB higher, and was no faster.
SAVE_OCDBT_CACHE_BYTES = 8 << 20


def make_context(ocdbt_cache_bytes: int = OCDBT_CACHE_BYTES) -> ts.Context:
    """A TensorStore context for one save or load."""
    return ts.Context(
        {
            # Object stores: the request concurrency and retries of cp.options.StorageOptions.
            **storage.context_resources(),
            "file_io_concurrency": {"limit": 128},
            # Files are flushed once, by the commit that fsyncs the whole checkpoint.
            "file_io_sync": False,
            # Array chunks are read once: caching them would only double memory.
            "cache_pool": {"total_bytes_limit": 0},
            "cache_pool#ocdbt": {"total_bytes_limit": ocdbt_cache_bytes},
        }
    )


def is_local(directory: epath.PathLike) -> bool:
    """Whether ``directory`` is on the local filesystem (not ``gs://``, ``s3://``, ...)."""
    return "://" not in os.fspath(directory)


def location_spec(directory: epath.PathLike) -> dict[str, Any]:
    """The kvstore spec of a directory itself (keys are file names relative to it)."""
    text = os.fspath(directory)
    if not is_local(text):  # s3://..., gs://...: configured as cp.options.StorageOptions says.
        return storage.kvstore_spec(text)
    return {"driver": "file", "path": text.rstrip("/") + "/"}


def open_location(directory: epath.PathLike) -> Any:
    """A future of the kvstore of a directory itself (``location_spec``), under the request
    retries and concurrency of ``cp.options.StorageOptions`` (TensorStore's defaults retry
    an object store that stopped answering for many minutes)."""
    context = ts.Context(storage.context_resources())
    return ts.KvStore.open(location_spec(directory), context=context)


def kvstore_spec(
    database: epath.PathLike, *, path: str | None = None, create: bool = False
) -> dict[str, Any]:
    """The spec of the OCDBT kvstore rooted at ``database`` (optionally at ``path`` in it)."""
    spec: dict[str, Any] = {
        "driver": "ocdbt",
        "base": location_spec(database),
        "cache_pool": "cache_pool#ocdbt",
    }
    if create:
        spec["config"] = dict(OCDBT_CONFIG)
    if path is not None:
        spec["path"] = path
    return spec


def open_kvstore(database: epath.PathLike, context: ts.Context, **options: Any) -> Any:
    """A future of the OCDBT kvstore of ``database`` (``options``: of ``kvstore_spec``).

    A local database's manifest is checked first (``check_manifest_size``; a ``stat``).
    An object store's is not (that costs a request): loads check it once, in
    ``start_node_check``; other readers call ``check_manifest_size`` themselves.

    Raises:
      cp.errors.MetadataError: the local manifest holds more than ``MAX_MANIFEST_BYTES``.
    """
    if is_local(database):
        check_manifest_size(database)
    return ts.KvStore.open(kvstore_spec(database, **options), context=context)


def check_manifest_size(database: epath.PathLike) -> None:
    """Refuses a database whose ``manifest.ocdbt`` holds more than ``MAX_MANIFEST_BYTES``,
    before TensorStore (which reads it whole) or this library reads it. A missing or
    unreadable manifest passes: the reads report it.

    Costs a ``stat`` for a local database; for an object store one ranged GET of the byte
    at the bound (TensorStore reads no range past an object's end: a small manifest
    answers OUT_OF_RANGE).

    Raises:
      cp.errors.MetadataError: naming the manifest (``cp.storage.file_too_large``).
    """
    root = os.fspath(database)
    if is_local(root):
        path = os.path.join(root, MANIFEST_FILE)
        try:
            size = os.stat(path).st_size
        except OSError:
            return
        if size > MAX_MANIFEST_BYTES:
            raise cp.storage.file_too_large(path, MAX_MANIFEST_BYTES)
        return
    if _remote_holds_more(root, MAX_MANIFEST_BYTES):
        raise cp.storage.file_too_large(f"{root.rstrip('/')}/{MANIFEST_FILE}", MAX_MANIFEST_BYTES)


def _remote_holds_more(root: str, max_bytes: int) -> bool:
    """Whether the object-store manifest of ``root`` holds more than ``max_bytes`` (one
    ranged GET; ``False`` when it is missing or cannot be read: the reads report that)."""
    try:
        base = open_location(root).result()
        result = base.read(MANIFEST_FILE, byte_range=slice(max_bytes, max_bytes + 1)).result()
    except ValueError:  # OUT_OF_RANGE: no byte there. Other failures: the reads report them.
        return False
    return bool(result.state == "value")


def database_directory(pytree_directory: epath.Path) -> epath.Path:
    """Where this process writes arrays.

    One process writes straight into the pytree directory's database. In a
    multi-process save each process writes its own ``ocdbt.process_<i>``
    database, which the primary host merges into the root at commit (as
    Orbax does), so that no two processes ever write one manifest.
    """
    if cp.multihost.process_count() == 1:
        return pytree_directory
    return pytree_directory / f"ocdbt.process_{cp.multihost.process_index()}"


@attrs.frozen
class Source:
    """A database to merge, and which of its keys to take.

    Attributes:
      directory: the source database's directory (inside the target's).
      prefixes: take only keys under these prefixes (e.g. ``"params.w/"``);
        ``None`` takes every key.
    """

    directory: epath.Path
    prefixes: tuple[str, ...] | None = None


def prefix_range(prefix: str) -> ts.KvStore.KeyRange:
    """The key range of every key that starts with ``prefix``."""
    raw = prefix.encode()
    end = raw.rstrip(b"\xff")
    end = end[:-1] + bytes([end[-1] + 1]) if end else b""
    return ts.KvStore.KeyRange(raw, end)


def merge_into(target: epath.Path, sources: Sequence[Source]) -> None:
    """Adds the chosen keys of every source to the database at ``target``, atomically.

    The key sets must not overlap (choose ``prefixes`` so that each key comes
    from one source). No array data is copied: the target's b-tree points at
    the sources' data files, by relative path, so the sources must live (and
    stay) under ``target``'s directory.
    """
    for source in sources:
        relative = os.path.relpath(os.fspath(source.directory), os.fspath(target))
        if relative.startswith(".."):
            raise ValueError(
                f"Database {source.directory} is not inside {target}: merged databases refer to "
                f"their sources' files by relative path."
            )
    context = make_context()
    destination = open_kvstore(target, context, create=True).result()
    with ts.Transaction(atomic=True) as transaction:
        into = destination.with_transaction(transaction)
        futures = []
        for source in sources:
            store = open_kvstore(source.directory, context).result()
            ranges = [None] if source.prefixes is None else map(prefix_range, source.prefixes)
            for key_range in ranges:
                options = {} if key_range is None else {"source_range": key_range}
                futures.append(store.experimental_copy_range_to(into, **options))
        for future in futures:
            future.result()


def flush_data_files(directory: epath.Path, done: set[str]) -> None:
    """Flushes the database's data files not flushed yet (they are immutable once written)."""
    if not is_local(directory):
        return  # An object store's writes are durable once acknowledged.
    data = os.path.join(os.fspath(directory), "d")
    try:
        names = os.listdir(data)
    except FileNotFoundError:
        return
    for name in names:
        if name in done:
            continue
        try:
            fd = os.open(os.path.join(data, name), os.O_RDONLY)
        except FileNotFoundError:
            continue  # A temporary file TensorStore renamed meanwhile; the commit flushes the rest.
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        done.add(name)
