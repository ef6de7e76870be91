"""Which arrays of a save are linked from an earlier checkpoint, and the record of this one.

A save under ``cp.reuse.current()`` (``reuse_from=``, or a Checkpointer with
``reuse_unchanged``) fingerprints every array of at least ``MIN_BYTES``
(``_fingerprint``): per shard this process writes, on the shard's device.
It records the fingerprints beside its database (``RECORD_FILE``: one per
process database, ignored by Orbax and TensorStore). An array whose layout
(kind, shape, dtype, chunk shape, storage options) and every fingerprint
equal the source's record, and whose chunks the source's b-tree places in
data files that are there with at least the recorded bytes, is *linked*: the
writer hard-links those files (on S3: copies them on the server, each copy
conditional on the ETag listed here) and points this database's keys at the
same offsets (``ocdbt.Linked``); its data never reaches the host. Every other
array is written as in any save, in data files of its own (``Writer.isolate``)
so that the next save can link them whole.

Reused chunks keep the CRC-32C the source wrote with them (in the shard's
bytes): nothing is recomputed, and loads and ``checkpointables verify`` check
them as any other.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from typing import Any

import attrs
import checkpointables as cp
import jax
import numpy as np
from etils import epath

from checkpointables_pytree import io, ocdbt, storage, tree, zarr3
from checkpointables_pytree.reuse import _fingerprint

__all__ = ["RECORD_FILE", "MIN_BYTES", "ReusePlan", "plan_reuse", "reuse_report"]

RECORD_FILE = "_REUSE.json"
# Smaller arrays are rewritten: a few KiB cost less than their fingerprint and link.
MIN_BYTES = 64 << 10
_FORMAT = 1


@attrs.frozen
class _Candidate:
    """One array this process may link: its shards (start, chunk key, data)."""

    name: str
    signature: str
    shards: list[tuple[list[int], str, Any]]
    on_device: bool


@attrs.define
class ReusePlan:
    """What ``plan_reuse`` decided: the record to write with the save, and its counts."""

    record: dict[str, Any]
    database: epath.Path | None = None  # Where the record goes (relative to the pytree).
    linked_bytes: int = 0

    def write(self, pytree_directory: epath.Path) -> None:
        """Writes the record beside this process's database, once its data files are
        written (on S3 it lists them)."""
        directory = ocdbt.database_directory(pytree_directory)
        cp.storage.make_dirs(directory)  # Nothing to make on an object store.
        content: dict[str, Any] = {"format": _FORMAT, "arrays": self.record}
        if not ocdbt.is_local(directory):  # The data objects' sizes and ETags, as the
            # server recorded them: a later save copies only objects that still match.
            root = os.fspath(directory).rstrip("/") + "/"
            listed = storage.list_objects(f"{root}d")
            content["files"] = {k[len(root) :]: [v.size, v.etag] for k, v in listed.items()}
        text = json.dumps(content, separators=(",", ":"))
        cp.storage.write_text(directory / RECORD_FILE, text)


def _signature(kind: str, array: Any, chunk_shape: Sequence[int], context: cp.Context) -> str:
    options = context.array_options
    return json.dumps(
        [
            kind,
            [int(s) for s in array.shape],
            np.dtype(array.dtype).str,
            [int(c) for c in chunk_shape],
            bool(options.use_compression),
            repr(options.storage_options),
        ]
    )


def _jax_candidate(name: str, array: jax.Array, context: cp.Context) -> _Candidate | None:
    if array.is_deleted() or not _fingerprint.supported(array.dtype):
        return None
    if cp.multihost.process_count() > 1 and array.is_fully_addressable:
        return None  # A value every process holds: who writes it is decided later.
    chunk_shape = io.chunk_shape_of(array)
    shape = tuple(int(s) for s in array.shape)
    shards = []
    for shard in array.addressable_shards:
        if shard.replica_id != 0:
            continue
        starts = [s.indices(d)[0] for s, d in zip(shard.index, shape, strict=True)]
        index = [b // c if c else 0 for b, c in zip(starts, chunk_shape, strict=True)]
        shards.append((starts, zarr3.chunk_key(name, index), shard.data))
    if not shards:
        return None  # Another process writes every part of it.
    signature = _signature("jax", array, chunk_shape, context)
    return _Candidate(name, signature, shards, True)


def _candidates(flat: tree.Flat, context: cp.Context) -> list[_Candidate]:
    """The arrays worth linking that this process writes."""
    options = context.array_options
    if options.storage_options_creator is not None or options.storage_options.dtype is not None:
        return []  # Per-leaf options or casts: layouts this module does not predict.
    found = []
    single = cp.multihost.process_count() == 1
    names = flat.structure.storage_names
    for name, value in zip(names, flat.values, strict=True):
        if int(getattr(value, "nbytes", 0)) < MIN_BYTES:
            continue
        if isinstance(value, jax.Array):
            candidate = _jax_candidate(name, value, context)
            if candidate is not None:
                found.append(candidate)
        elif type(value) is np.ndarray and single and value.dtype.kind in "biufc":
            shape = tuple(value.shape)
            signature = _signature("numpy", value, shape, context)
            key = zarr3.chunk_key(name, (0,) * len(shape))
            found.append(_Candidate(name, signature, [([0] * len(shape), key, value)], False))
    return found


def _fingerprints(candidates: Sequence[_Candidate]) -> dict[str, list[str]]:
    """Name -> the fingerprint of each of its shards (device ones computed on device)."""
    device = [s[2] for c in candidates if c.on_device for s in c.shards]
    host = [s[2] for c in candidates if not c.on_device for s in c.shards]
    prints = iter(_fingerprint.fingerprint_shards(device))
    host_prints = iter(_fingerprint.fingerprint_numpy(host))
    result = {}
    for c in candidates:
        source = prints if c.on_device else host_prints
        result[c.name] = [next(source) for _ in c.shards]
    return result


def _read_record(source: epath.Path, *, own: bool = False) -> dict[str, Any]:
    """The source's record for this process (``own``: the record in ``source`` itself):
    ``{"arrays": ..., "files": ...}``, either missing if the record has none (``{}``: no
    record, or unreadable)."""
    path = (source if own else ocdbt.database_directory(source)) / RECORD_FILE
    try:
        data = json.loads(cp.storage.read_text(path))
    except (OSError, ValueError):  # Missing or unreadable (cp.errors.StorageError: OSError).
        return {}
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        return {}
    return {k: v for k in ("arrays", "files") if isinstance(v := data.get(k), dict)}


def _entry(c: _Candidate, prints: list[str]) -> dict[str, Any]:
    shards = [[starts, p] for (starts, _, _), p in zip(c.shards, prints, strict=True)]
    return {"signature": c.signature, "shards": shards}


def _same_layout(entry: dict[str, Any], c: _Candidate) -> bool:
    """Whether a recorded array has ``c``'s layout and shards (fingerprints aside)."""
    shards = entry.get("shards") or []
    return entry.get("signature") == c.signature and [s[0] for s in shards] == [
        s[0] for s in c.shards
    ]


class _Files:
    """The source's data files, each looked up once: a local file's size, or on S3 the
    object as listed (size and ETag; one LIST per directory of data files), if it is the
    object the source's record lists."""

    def __init__(self, source: epath.Path, recorded: dict[str, Any]) -> None:
        self._local = ocdbt.is_local(source)
        self._root = os.fspath(ocdbt.database_directory(source)).rstrip("/") + "/"
        self._recorded = recorded  # On S3: "d/<name>" -> [size, ETag] when it was saved.
        self._sizes: dict[str, int] = {}
        self.listed: dict[str, storage.ObjectInfo] = {}

    def list(self, places: Sequence[Any]) -> None:
        """Lists the directories of ``places``' files (on S3; blocking)."""
        if not self._local:
            for directory in sorted({p.file.rpartition("/")[0] for p in places}):
                self.listed.update(storage.list_objects(directory))

    def holds(self, location: Any) -> bool:
        """Whether the file of ``location`` is there with at least the bytes it names."""
        size = self._sizes.get(location.file)
        if size is None:
            size = self._size(location.file)
            self._sizes[location.file] = size
        return bool(size >= location.offset + location.length)

    def _size(self, file: str) -> int:
        """The file's size (-1: missing, or an object other than the one recorded)."""
        if not self._local:
            found = self.listed.get(file)
            recorded = self._recorded.get(file.removeprefix(self._root))
            if found is None or (recorded is not None and recorded != [found.size, found.etag]):
                return -1
            return found.size
        try:
            return os.stat(file).st_size
        except OSError:
            return -1


async def _link(
    source: epath.Path,
    matching: Sequence[_Candidate],
    writer: io.Writer,
    recorded: dict[str, Any],
) -> int:
    """Links the chunks of ``matching`` arrays the source holds in data files; returns the
    bytes linked. An array with a chunk missing, inline, in a short file, or in an object
    other than the one ``recorded`` (S3) is written."""
    keys = [key for c in matching for _, key, _ in c.shards]
    if not keys:
        return 0
    try:
        found = await ocdbt.locate(ocdbt.DatabaseIndex(source), keys)
    except (OSError, ValueError, cp.errors.IntegrityError):  # A damaged source: written afresh.
        return 0
    files = _Files(source, recorded)
    await asyncio.to_thread(files.list, list(found.values()))
    linked = 0
    for c in matching:
        places = [found.get(key) for _, key, _ in c.shards]
        if any(p is None or not files.holds(p) for p in places):
            continue
        writer.linked[c.name] = [
            (key, ocdbt.Linked(p.file, p.offset, p.length, files.listed.get(p.file)))
            for (_, key, _), p in zip(c.shards, places, strict=True)
            if p is not None
        ]
        linked += sum(int(data.nbytes) for _, _, data in c.shards)
    return linked


def _usable(directory: epath.Path, source: epath.Path | None, context: cp.Context) -> bool:
    """Whether this save can link files at all (says once in the log why not): both on a
    local disk (hard links), or both on S3 (server-side copies)."""
    if not context.array_options.ocdbt_fast_path:
        cp.reuse.log_once(
            "fast_path", "Incremental saves need the OCDBT fast path; writing every array."
        )
        return False
    paths = [os.fspath(p) for p in (directory, source) if p is not None]
    if all(ocdbt.is_local(p) for p in paths) or storage.can_copy_on_server(*paths):
        return True
    remote = next(p for p in paths if not ocdbt.is_local(p))
    scheme = remote.split("://")[0]
    why = "botocore is not installed (pip install 'checkpointables[s3]')"
    if scheme != "s3" or any(ocdbt.is_local(p) for p in paths):
        why = "it has no server-side copy here"
    cp.reuse.log_once(
        f"remote:{scheme}",
        f"Incremental saves link files on local storage and copy objects on S3 only; "
        f"{remote}: {why}, so every array is written as in a plain save.",
    )
    return False


async def plan_reuse(
    directory: epath.Path,
    flat: tree.Flat,
    context: cp.Context,
    reuse: cp.reuse.SaveReuse,
    writer: io.Writer,
) -> ReusePlan | None:
    """Fingerprints the arrays of ``flat``, links the unchanged ones into ``writer`` and
    returns the record to write with the save (``None``: storage that cannot link)."""
    source = reuse.source_of(directory.name)
    if not _usable(directory, source, context):
        return None
    candidates = _candidates(flat, context)
    recorded = _read_record(source) if source is not None else {}
    earlier = recorded.get("arrays", {})
    frozen = reuse.frozen
    known = {}
    to_print = []
    for c in candidates:
        entry = earlier.get(c.name)
        if frozen is not None and entry and frozen(c.name) and _same_layout(entry, c):
            known[c.name] = entry  # Declared frozen: the source's fingerprints stand.
            continue
        to_print.append(c)
    prints = _fingerprints(to_print)
    record = {c.name: _entry(c, prints[c.name]) for c in to_print}
    record.update(known)
    matching = [c for c in candidates if _same(earlier.get(c.name), record[c.name])]
    plan = ReusePlan(record)
    writer.isolate = True
    if source is not None and matching:
        plan.linked_bytes = await _link(source, matching, writer, recorded.get("files", {}))
        reuse.add_reused(plan.linked_bytes)
        for name in writer.linked:  # For `checkpointables inspect`.
            record[name] = dict(record[name], reused_from=source.parent.name)
    return plan


def _same(earlier: dict[str, Any] | None, now: dict[str, Any]) -> bool:
    """Whether a recorded array has the layout and fingerprints of one saved now."""
    return bool(earlier) and all(earlier.get(k) == now[k] for k in ("signature", "shards"))


def reuse_report(pytree_directory: epath.Path) -> dict[str, str | None]:
    """Array name -> the checkpoint its data was linked from (``None``: written), from the
    records of every process database (``{}``: saved without reuse)."""
    report: dict[str, str | None] = {}
    databases = [
        pytree_directory / e.name
        for e in cp.storage.list_dir(pytree_directory)
        if e.is_dir and e.name.startswith("ocdbt.process_")
    ]
    for record in [pytree_directory, *databases]:
        for name, entry in _read_record(record, own=True).get("arrays", {}).items():
            source = entry.get("reused_from") if isinstance(entry, dict) else None
            if report.get(name) is None:
                report[name] = source if isinstance(source, str) else None
    return report
