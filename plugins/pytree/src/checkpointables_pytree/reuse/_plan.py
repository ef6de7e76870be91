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
so that the next save can link them whole; arrays declared frozen, always
linked together, share theirs (``Writer.shared``), and so do the arrays that
changed since the source, which wrote them too (``_rewritten``): most likely
they change at every save, and no later save links them.

On a local disk, arrays on CPU devices are probed first (``_probe``): those
whose probes differ from the record's have changed and are written without a
fingerprint (the record holds ``None`` for it, and their probes); an array
with equal probes against such a record is linked only if its bytes equal
the source's chunk (``_same_stored``), and gets its fingerprint recorded.

Reused chunks keep the CRC-32C the source wrote with them (in the shard's
bytes): nothing is recomputed, and loads and ``checkpointables verify`` check
them as any other.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Collection, Sequence
from typing import Any

import attrs
import checkpointables as cp
import jax
import numpy as np
from etils import epath

from checkpointables_pytree import io, ocdbt, storage, tree, zarr3
from checkpointables_pytree.reuse import _fingerprint, _known, _prefetched
from checkpointables_pytree.reuse._candidates import MIN_BYTES, Candidate, candidates
from checkpointables_pytree.reuse._sources import Source

__all__ = ["RECORD_FILE", "MIN_BYTES", "ReusePlan", "plan_reuse", "reuse_report"]

RECORD_FILE = "_REUSE.json"
# A record holds about 100 bytes an array shard: a larger one is no record of ours.
_MAX_RECORD_BYTES = cp.metadata_checksums.MAX_FILE_BYTES
# 2: chunk shapes under a host-memory budget are the budget's. Records of format 1 may
# state an unbudgeted chunk shape for chunks a budget cut smaller (reuse then linked by the
# unbudgeted layout): their layout is trusted only where each chunk's length proves it.
_FORMAT = 2
_FORMATS_READ = (1, 2)


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
        if ocdbt.is_local(directory):  # Nothing to make on an object store; never the
            # pytree's directory again, if someone deleted it during the save.
            ocdbt.make_directories(os.fspath(directory))
        content: dict[str, Any] = {"format": _FORMAT, "arrays": self.record}
        # The data files as they are now: a later save links only files that still match.
        content["files"] = _data_files(directory)
        text = json.dumps(content, separators=(",", ":"))
        cp.storage.write_text(directory / RECORD_FILE, text)


def _data_files(database: epath.Path) -> dict[str, list[Any]]:
    """``"d/<name>" -> [size, ETag]`` of each data object of ``database`` on S3, as the
    server lists it; on a local disk ``[size, mtime in ns]`` of each file (a write into
    one, or a file put in its place, changes its time)."""
    root = os.fspath(database).rstrip("/") + "/"
    if not ocdbt.is_local(database):
        listed = storage.list_objects(f"{root}d")
        return {k[len(root) :]: [v.size, v.etag] for k, v in listed.items()}
    try:
        entries = list(os.scandir(f"{root}d"))
    except FileNotFoundError:
        return {}
    files = {}
    for entry in entries:
        status = entry.stat(follow_symlinks=False)
        files[f"d/{entry.name}"] = [status.st_size, status.st_mtime_ns]
    return files


def _fingerprints(found: Sequence[Candidate]) -> dict[str, list[str]]:
    """Name -> the fingerprint of each of its shards (device ones computed on device; those
    of a ``jax.Array`` object on accelerators fingerprinted before, kept: ``_known``)."""
    # Not on CPU devices: there a jax.Array may share a NumPy array's memory (device_put
    # and DLPack do not copy), which its owner can write in place.
    keeping = {c.name for c in found if c.array is not None and not _on_cpu(c.array)}
    result = {}
    for c in found:
        if c.name in keeping and (kept := _known.kept_prints(c.array)) is not None:
            result[c.name] = kept
    found = [c for c in found if c.name not in result]
    device = [s[2] for c in found if c.on_device for s in c.shards]
    host = [s[2] for c in found if not c.on_device for s in c.shards]
    prints = iter(_fingerprint.fingerprint_shards(device))
    host_prints = iter(_fingerprint.fingerprint_numpy(host))
    for c in found:
        source = prints if c.on_device else host_prints
        result[c.name] = [next(source) for _ in c.shards]
        if c.name in keeping:
            _known.keep_prints(c.array, result[c.name])
    return result


def _read_record(source: epath.Path, *, own: bool = False) -> dict[str, Any]:
    """The source's record for this process (``own``: the record in ``source`` itself):
    ``{"arrays": ..., "files": ..., "format": ...}``, the first two missing if the record
    has none (``{}``: no record, or unreadable)."""
    path = (source if own else ocdbt.database_directory(source)) / RECORD_FILE
    try:
        # A larger record is no record of ours: not read (hundreds of MiB in memory).
        raw = cp.storage.read_bytes(path, max_bytes=_MAX_RECORD_BYTES)
        data = cp.safe_json.loads(raw, source=path)
    except (OSError, ValueError, cp.errors.IntegrityError):
        # Missing, unreadable (cp.errors.StorageError: OSError), a pipe or a directory
        # (IntegrityError), damaged or too large (cp.errors.MetadataError: ValueError): nothing
        # recorded, and every array of this save is written.
        return {}
    if not isinstance(data, dict) or data.get("format") not in _FORMATS_READ:
        return {}
    found: dict[str, Any] = {
        k: v for k in ("arrays", "files") if isinstance(v := data.get(k), dict)
    }
    found["format"] = data["format"]
    if "arrays" in found:
        found["arrays"] = {k: v for k, v in found["arrays"].items() if _well_formed(v)}
    return found


def _well_formed(entry: Any) -> bool:
    """Whether a recorded array has the form ``_entry`` gives it. Others (a damaged or
    forged record's) are left out: their arrays are written, never compared."""
    if not isinstance(entry, dict) or not isinstance(entry.get("signature"), str):
        return False
    shards, probes = entry.get("shards"), entry.get("probes", [])
    return (
        isinstance(shards, list)
        and all(_well_formed_shard(shard) for shard in shards)
        and isinstance(probes, list)
        and all(isinstance(p, str) for p in probes)
        and isinstance(entry.get("reused_from", ""), str)
    )


def _well_formed_shard(shard: Any) -> bool:
    """``[starts, fingerprint]``: a list of ints, and a string or ``None``."""
    return (
        isinstance(shard, list)
        and len(shard) == 2
        and isinstance(shard[0], list)
        and all(type(i) is int for i in shard[0])
        and (shard[1] is None or isinstance(shard[1], str))
    )


def _entry(
    c: Candidate, prints: Sequence[str | None], probes: list[str] | None = None
) -> dict[str, Any]:
    """``c``'s record: its layout, each shard's fingerprint (``None``: not computed, for an
    array whose probes showed that it changed) and, where taken, its probes."""
    shards = [[starts, p] for (starts, _, _), p in zip(c.shards, prints, strict=True)]
    entry: dict[str, Any] = {"signature": c.signature, "shards": shards}
    if probes is not None:
        entry["probes"] = probes
    return entry


def _same_layout(entry: dict[str, Any], c: Candidate) -> bool:
    """Whether a recorded array has ``c``'s layout and shards (fingerprints aside)."""
    shards = entry.get("shards") or []
    return entry.get("signature") == c.signature and [s[0] for s in shards] == [
        s[0] for s in c.shards
    ]


def _linkable(directory: epath.Path, context: cp.Context) -> bool:
    """Whether this save can link files at all (says once in the log why not): on a local
    disk (hard links), or on S3 (server-side copies)."""
    if not context.array_options.ocdbt_fast_path:
        cp.reuse.log_once(
            "fast_path", "Incremental saves need the OCDBT fast path; writing every array."
        )
        return False
    path = os.fspath(directory)
    if ocdbt.is_local(path) or storage.can_copy_on_server(path):
        return True
    scheme = path.split("://")[0]
    why = "it has no server-side copy here"
    if scheme == "s3":
        why = "botocore is not installed (pip install 'checkpointables[s3]')"
    cp.reuse.log_once(
        f"remote:{scheme}",
        f"Incremental saves link files on local storage and copy objects on S3 only; "
        f"{path}: {why}, so every array is written as in a plain save.",
    )
    return False


def _reachable(directory: epath.Path, source: epath.Path | None) -> epath.Path | None:
    """``source`` if this save can link its files: both on one local file system (hard
    links do not cross file systems), or both on S3. Otherwise ``None`` (said once in the
    log): the save writes every array, and records fingerprints for the saves after it."""
    if source is None:
        return None
    here, there = os.fspath(directory), os.fspath(source)
    if ocdbt.is_local(here) and ocdbt.is_local(there):
        if _file_system(here) == _file_system(there):
            return source
        why = "is on another file system than this save (hard links cannot cross them)"
    elif storage.can_copy_on_server(here, there):
        return source
    else:
        why = "is on other storage than this save (links and server-side copies work "
        why += "within one local file system, or within S3)"
    cp.reuse.log_once(
        f"elsewhere:{there}",
        f"reuse_from={source.parent} {why}: this save writes every array and records "
        f"fingerprints for the saves after it.",
    )
    return None


def _file_system(path: str) -> int:
    """The device number of the file system holding ``path`` (or its nearest existing
    parent: a save's directory may not exist yet)."""
    path = os.path.abspath(path)
    while True:
        try:
            return os.stat(path).st_dev
        except FileNotFoundError:
            parent = os.path.dirname(path.rstrip("/"))
            if parent == path:
                raise
            path = parent


async def plan_reuse(
    directory: epath.Path,
    flat: tree.Flat,
    context: cp.Context,
    reuse: cp.reuse.SaveReuse,
    writer: io.Writer,
) -> ReusePlan | None:
    """Fingerprints the arrays of ``flat``, links the unchanged ones into ``writer`` and
    returns the record to write with the save (``None``: storage that cannot link)."""
    if not _linkable(directory, context):
        return None
    source, recorded, kept = _source_of(directory, reuse)
    earlier = recorded.get("arrays", {})
    comparable = _bytes_comparable(directory, context)
    # The source's b-tree is read on a worker thread while the arrays are looked at.
    located, origin = _located(directory, source, recorded, comparable, kept)
    found = candidates(flat, context)
    _prefetched.after_commit(reuse, directory, _keys(found), _read_record)
    _warn_if_unmatched(found, earlier, source)
    known, to_print, linkable = _compare_layouts(found, earlier, reuse.frozen)
    probed = _Probed()
    if comparable:
        to_print += _changed_though_frozen(found, known, reuse)
        probed = _probe(to_print, earlier)
    if located is not None and not earlier:  # No record: what can be compared is looked up.
        linkable = [c for c in to_print if c.name in probed.probes and _unpadded(c)]
    if probed.changed:  # Written, not fingerprinted, not looked up in the source.
        to_print = [c for c in to_print if c.name not in probed.changed]
        linkable = [c for c in linkable if c.name not in probed.changed]
    writer.isolate = True
    writer.linkable = frozenset(c.name for c in found)
    if reuse.frozen is not None:
        writer.shared = {c.name: "frozen" for c in found if reuse.frozen(c.name)}
        if found and not writer.shared:
            _warn_nothing_frozen(found, reuse.frozen)
    # The fingerprints (XXH3's threads, or the devices) while the source's files are
    # looked up: the chunks of every array that may match, whether it does or not.
    tasks: list[asyncio.Future[Any]] = [asyncio.ensure_future(_fingerprinted(to_print))]
    if located is not None and linkable:
        tasks.append(asyncio.ensure_future(located.locate(_keys(linkable))))
    prints, *places = await storage.gather_settled(tasks)
    record = {c.name: _entry(c, prints[c.name], probed.probes.get(c.name)) for c in to_print}
    for c in probed.changed.values():
        record[c.name] = _entry(c, [None] * len(c.shards), probed.probes[c.name])
    record.update(known)
    plan = ReusePlan(record)
    if located is not None and places:
        matching = [c for c in linkable if _same(earlier.get(c.name), record[c.name])]
        if probed.unprinted:  # Recorded without fingerprints: their bytes are compared.
            matching += await asyncio.to_thread(_same_stored, probed.unprinted, probed, places[0])
        if not earlier:  # A source saved without reuse: what it stored is compared.
            matching += await asyncio.to_thread(_same_in_plain, source, linkable, probed, places[0])
        plan.linked_bytes = _link(located, matching, places[0], writer, recorded, context)
        reuse.add_reused(plan.linked_bytes)
        for name in writer.linked:  # For `checkpointables inspect`.
            record[name] = dict(record[name], reused_from=origin)
    for name in _rewritten(record, earlier, probed, writer):
        writer.shared.setdefault(name, "rewritten")
    return plan


def _keys(found: Sequence[Candidate]) -> list[str]:
    """The keys of the chunks of ``found``, and of their ``zarr.json``."""
    return [key for c in found for key in (*c.keys, _metadata_key(c.name))]


def _source_of(
    directory: epath.Path, reuse: cp.reuse.SaveReuse
) -> tuple[epath.Path | None, dict[str, Any], _prefetched.Prefetched | None]:
    """The source pytree this save links from, its record, and what the save that wrote it
    read back after its commit (its b-tree, its data objects listed), where that commit is
    the one there now (``_prefetched``; object stores). Otherwise read now (``None``)."""
    kept = _prefetched.take(reuse, directory.name)
    if kept is not None:
        return _reachable(directory, reuse.source_of(directory.name)), kept.record, kept
    source = _reachable(directory, _named(reuse.source_of(directory.name)))
    return source, _read_record(source) if source is not None else {}, None


def _some(names: Collection[str]) -> str:
    """A few of ``names``, quoted, for a message: ``'a.w', 'b.w', ... (12 in all)``."""
    shown = sorted(names)[:3]
    more = f", ... ({len(names)} in all)" if len(names) > len(shown) else ""
    return ", ".join(map(repr, shown)) + more


def _warn_if_unmatched(
    found: Sequence[Candidate], earlier: dict[str, Any], source: epath.Path | None
) -> None:
    """Warns once per source where its record tracks arrays and none of this save's is
    named as one of them: arrays match by name, and nothing can be reused (a subtree
    saved, whose leaves' names lack the prefix the source's have, say)."""
    if source is None or not earlier or not found or any(c.name in earlier for c in found):
        return
    cp.reuse.log_once(
        f"unmatched:{source}",
        f"None of this save's arrays is named as an array of reuse_from={source.parent} "
        f"(there: {_some(earlier)}; here: {_some([c.name for c in found])}): arrays are "
        f"matched by name, so every array is written. Save the structure the source "
        f"holds (a subtree's names lack its prefix: save {{'params': params}}, not params).",
        level=logging.WARNING,
    )


def _same_in_plain(
    source: epath.Path | None,
    found: Sequence[Candidate],
    probed: _Probed,
    places: dict[str, ocdbt.ValueLocation],
) -> list[Candidate]:
    """``_same_stored`` for a source saved without reuse (no record), warning once where it
    stores none of the arrays by their names here (``_warn_if_unmatched``'s case)."""
    if source is not None and found and not any(k in places for c in found for k in c.keys):
        cp.reuse.log_once(
            f"unmatched:{source}",
            f"reuse_from={source.parent} stores none of this save's arrays under their names "
            f"here ({_some([c.name for c in found])}): arrays are matched by name, so every "
            f"array is written. Save the structure the source holds (a subtree's names lack "
            f"its prefix: save {{'params': params}}, not params); `checkpointables inspect "
            f"{source.parent}` lists its names.",
            level=logging.WARNING,
        )
    return _same_stored(found, probed, places)


def _warn_nothing_frozen(found: Sequence[Candidate], frozen: Any) -> None:
    """Warns once per predicate that declared none of the arrays it was asked about frozen:
    most likely names of another form than the stored ones it is given."""
    names = _some([c.name for c in found])
    cp.reuse.log_once(
        f"unfrozen:{id(frozen)}",
        f"The reuse_unchanged predicate declared none of this save's arrays of at least "
        f"64 KiB frozen. It is given names as stored, keys joined by dots ({names}), "
        f"as `checkpointables inspect` lists them under 'incremental save'; the "
        f"fingerprints decide for every array.",
        level=logging.WARNING,
    )


def _bytes_comparable(directory: epath.Path, context: cp.Context) -> bool:
    """Whether this save's chunks hold their arrays' bytes as they are, in local files
    that can be read back (probes and byte comparisons apply)."""
    return ocdbt.is_local(directory) and not context.array_options.use_compression


def _named(source: epath.Path | None) -> epath.Path | None:
    """The source's checkpointable that this one reuses from: the one of its name or,
    where there is none, the source's only pytree (a Checkpointer saves its tree as
    ``state``, ``cp.save_pytree`` as ``pytree``: an export of a training step reuses
    from it). Where neither is there, says so (a warning: reuse was asked for, and this
    checkpointable gets none) and returns ``None``."""
    if source is None or cp.storage.exists(source):
        return source
    checkpoint, name = source.parent, source.name
    held = sorted(e.name for e in cp.storage.list_dir(checkpoint) if e.is_dir)
    pytrees = [n for n in held if cp.storage.exists(checkpoint / n / ocdbt.MANIFEST_FILE)]
    if len(pytrees) == 1:
        cp.reuse.log_once(
            f"renamed:{source}",
            f"reuse_from={checkpoint} holds no checkpointable {name!r}: {name!r} reuses "
            f"from its only pytree, {pytrees[0]!r}.",
        )
        return checkpoint / pytrees[0]
    cp.reuse.log_once(
        f"unnamed:{source}",
        f"reuse_from={checkpoint} holds no checkpointable {name!r} (it holds "
        f"{', '.join(map(repr, held)) or 'none'}), so this save writes every array of "
        f"{name!r}. Checkpointables reuse from the source's of the same name: pass "
        f"checkpointable_name= (cp.save_pytree saves its tree as 'pytree', a "
        f"Checkpointer as 'state'), or save_checkpointables with the source's names.",
        level=logging.WARNING,
    )
    return None


def _located(
    directory: epath.Path,
    source: epath.Path | None,
    recorded: dict[str, Any],
    comparable: bool,
    kept: _prefetched.Prefetched | None = None,
) -> tuple[Source | None, str]:
    """The source to link from and how the record names it (``None``: nothing can be
    linked). A source without a record (saved without reuse) is one only where its stored
    bytes can be compared (``comparable``); the log says once what happens. ``kept``:
    its b-tree and listing as read back after its commit."""
    if source is None or recorded.get("arrays") == {}:
        return None, ""  # None, or a record of no arrays (all small): nothing to link.
    if not recorded.get("arrays"):
        _say_what_without_a_record(source, comparable)
        if not comparable:
            return None, ""
    # A record's files are checked (none listed: none linked); without a record the
    # stored bytes are compared instead.
    files = recorded.get("files", {}) if recorded.get("arrays") else None
    if files == {} and "files" not in recorded:
        cp.reuse.log_once(
            f"unlisted:{source}",
            f"reuse_from={source.parent} was saved by an earlier version, whose record lists "
            f"no data files to check: this save writes every array, and the next links "
            f"from it.",
        )
    if kept is None:
        return Source(source, files), _origin(directory, source)
    located = Source(source, files, kept.index, kept.listed, kept.directories)
    return located, _origin(directory, source)


def _origin(directory: epath.Path, source: epath.Path) -> str:
    """How the record names the source checkpoint: by its name beside this one (a
    Checkpointer's step), else by its path."""
    checkpoint, beside = os.fspath(source.parent), os.fspath(directory.parent.parent)
    if ocdbt.is_local(checkpoint):
        checkpoint, beside = os.path.abspath(checkpoint), os.path.abspath(beside)
    if os.path.dirname(checkpoint) == beside:
        return source.parent.name
    return checkpoint


def _say_what_without_a_record(source: epath.Path, comparable: bool) -> None:
    """Logs once (``checkpointables.reuse``, INFO) what a save does with a source saved
    without reuse (no record of fingerprints)."""
    what = (
        "this save links the arrays on CPU devices whose bytes equal what it stored and "
        "writes the others"
        if comparable
        else f"this save writes every array of {source.name!r}"
    )
    cp.reuse.log_once(
        f"no-record:{source}",
        f"reuse_from={source.parent}: its {source.name!r} has no record of fingerprints (it "
        f"was saved without reuse), so {what}; it records fingerprints for the next save.",
    )


def _rewritten(
    record: dict[str, Any], earlier: dict[str, Any], probed: _Probed, writer: io.Writer
) -> list[str]:
    """The arrays that changed since the source, which wrote them too (did not link them):
    those that change at every save (adapters and their optimizer state, the weights of a
    full fine-tune). The next save will most likely write them again, so files of their
    own would only cost this save a file each to write and flush; they share files as in
    a plain save. An array reused before (an EMA updated now and then), new, or written
    for want of a comparable record keeps files of its own, for the next save to link."""
    return [
        name
        for name, now in record.items()
        if name not in writer.linked
        and (entry := earlier.get(name))
        and "reused_from" not in entry
        and (name in probed.changed or _changed(entry, now))
    ]


def _changed(entry: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether the fingerprints prove a change: recorded for every shard, of one kind, the
    layout the same, and not all equal."""
    shards = entry.get("shards") or []
    before, after = [p for _, p in shards], [p for _, p in now["shards"]]
    return (
        entry.get("signature") == now["signature"]
        and [s[0] for s in shards] == [s[0] for s in now["shards"]]
        and all(isinstance(p, str) and p for p in (*before, *after))
        and [p[0] for p in before] == [p[0] for p in after]
        and before != after
    )


async def _fingerprinted(found: Sequence[Candidate]) -> dict[str, list[str]]:
    """``_fingerprints`` on a worker thread (its waits are the hashing threads' or the
    devices'), so that the event loop reads the source meanwhile."""
    return await asyncio.to_thread(_fingerprints, found) if found else {}


def _compare_layouts(
    found: Sequence[Candidate], earlier: dict[str, Any], frozen: cp.reuse.Frozen | None
) -> tuple[dict[str, Any], list[Candidate], list[Candidate]]:
    """The record of the arrays declared frozen that the source holds with their layout
    (its fingerprints stand), the arrays to fingerprint, and those with the layout the
    source recorded (which may be linked)."""
    known: dict[str, Any] = {}
    to_print = []
    linkable = []
    for c in found:
        entry = earlier.get(c.name)
        if not entry or not _same_layout(entry, c):
            to_print.append(c)
            continue
        linkable.append(c)
        if frozen is not None and frozen(c.name):
            # Declared frozen: the source's fingerprints stand (not where it came from).
            known[c.name] = {k: entry[k] for k in ("signature", "shards", "probes") if k in entry}
        else:
            to_print.append(c)
    return known, to_print, linkable


# (the run's root, id of its frozen predicate, name) of the declared leaves whose probes
# matched once: a run, not a predicate (one predicate object may serve several runs).
_FROZEN_SEEN: set[tuple[str, int, str]] = set()


def _changed_though_frozen(
    found: Sequence[Candidate], known: dict[str, Any], reuse: cp.reuse.SaveReuse
) -> list[Candidate]:
    """The arrays declared frozen whose probes differ from the source's, on CPU devices,
    until they once match (a leaf a predicate names by mistake, a trained one, changes at
    the first save; probes cost 10-30 us an array): they changed, so they leave ``known``,
    are said once in a WARNING, and are written. Elsewhere the declaration is trusted."""
    changed = []
    run = os.fspath(reuse.source.parent) if reuse.source is not None else ""
    for c in found:
        recorded = known[c.name].get("probes") if c.name in known else None
        seen = (run, id(reuse.frozen), c.name)
        if recorded is None or seen in _FROZEN_SEEN or (views := _host_views(c)) is None:
            continue  # Not declared and recorded, matched before, or not on CPU devices.
        probes = [_fingerprint.probe(v) for v in views]
        if not _comparable(recorded, probes) or probes == recorded:
            _FROZEN_SEEN.add(seen)
            continue
        del known[c.name]
        changed.append(c)
    if changed:  # One line for them all: a predicate naming a trained subtree names many.
        names = [c.name for c in changed]
        cp.reuse.log_once(
            f"frozen-changed:{','.join(names)}",
            f"{_some(names)} {'is' if len(names) == 1 else 'are'} declared frozen "
            f"(reuse_unchanged) but changed since the step it would be reused from: written, "
            f"not linked. Fix the predicate: on accelerators a declared leaf is linked "
            f"unchecked.",
            level=logging.WARNING,
        )
    return changed


@attrs.define
class _Probed:
    """What the probes of the arrays on CPU devices showed (``_probe``)."""

    probes: dict[str, list[str]] = attrs.field(factory=dict)  # Per shard, for the record.
    views: dict[str, list[np.ndarray]] = attrs.field(factory=dict)  # Their shards' bytes.
    # Surely changed (probes differ from the source's): written without a fingerprint.
    changed: dict[str, Candidate] = attrs.field(factory=dict)
    # Equal probes, but the source recorded no fingerprint: their bytes are compared.
    unprinted: list[Candidate] = attrs.field(factory=list)


def _probe(to_print: Sequence[Candidate], earlier: dict[str, Any]) -> _Probed:
    """Probes (``_fingerprint.probe``) every array of ``to_print`` on CPU devices, whose
    bytes are in host memory already, and sorts those the source holds with their layout.

    Only arrays whose chunks hold their bytes as they are (no padding; the save
    is uncompressed and local) are left without a fingerprint: a later save
    with equal probes can then compare their bytes with the chunk itself.
    """
    probed = _Probed()
    for c in to_print:
        views = _host_views(c)
        if views is None:
            continue
        probes = probed.probes[c.name] = [_fingerprint.probe(v) for v in views]
        entry = earlier.get(c.name)
        recorded = entry.get("probes") if entry and _same_layout(entry, c) else None
        if not _comparable(recorded, probes):
            continue  # Fingerprinted: a new array or layout.
        if recorded != probes:
            if _unpadded(c):
                probed.changed[c.name] = c
        elif any(p is None for _, p in entry["shards"]):  # type: ignore[index]
            probed.views[c.name] = views
            probed.unprinted.append(c)
    return probed


def _host_views(c: Candidate) -> list[np.ndarray] | None:
    """The bytes of each shard of a ``jax.Array`` on CPU devices, viewed (no copy), or
    ``None`` for others (NumPy arrays; accelerators fingerprint on the device)."""
    if c.array is None or not _on_cpu(c.array):
        return None
    return [_fingerprint.host_bytes(np.asarray(data)) for _, _, data in c.shards]


def _on_cpu(array: jax.Array) -> bool:
    """Whether ``array`` is on JAX's CPU devices (its bytes in host memory)."""
    return all(d.platform == "cpu" for d in array.devices())


def _comparable(recorded: Any, probes: list[str]) -> bool:
    """Whether ``recorded`` are probes of this kind, one per shard (earlier records, and
    those of other storage, have none)."""
    return (
        isinstance(recorded, list)
        and len(recorded) == len(probes)
        and all(isinstance(p, str) and p.startswith(_fingerprint.PROBE_KIND) for p in recorded)
    )


def _unpadded(c: Candidate) -> bool:
    """Whether each shard of ``c`` fills its chunk (the chunk's bytes are the shard's)."""
    chunk_shape = json.loads(c.signature)[3]
    return all(list(data.shape) == chunk_shape for _, _, data in c.shards)


def _same_stored(
    found: Sequence[Candidate], probed: _Probed, places: dict[str, ocdbt.ValueLocation]
) -> list[Candidate]:
    """The arrays of ``found`` (probed, unpadded) each of whose shards the source stores as
    exactly what this save would write: the same probe, then the same shard index and the
    same bytes, compared in full. For arrays the source recorded without fingerprints
    (``probed.unprinted``) and for sources saved without a record."""
    same = []
    for c in found:
        views = probed.views.get(c.name) or _host_views(c)
        if views is None:
            continue
        shards = zip(c.shards, views, probed.probes[c.name], strict=True)
        if all(_stored_equals(places.get(key), view, p) for (_, key, _), view, p in shards):
            same.append(c)
    return same


def _stored_equals(place: ocdbt.ValueLocation | None, view: np.ndarray, probe: str) -> bool:
    """Whether the value at ``place`` (a local file) is a plain chunk of ``view``'s bytes,
    its checksum included (a damaged one would fail every step that links it)."""
    nbytes = view.nbytes
    if place is None or place.length != nbytes + zarr3.SHARD_TRAILER_BYTES:
        return False
    try:  # Mapped: the probe reads a few pages; only an array that passes it is read whole.
        stored = np.memmap(place.file, np.uint8, "r", place.offset, (place.length,))
    except (OSError, ValueError):  # Gone, or shorter than the b-tree says.
        return False
    return (
        _fingerprint.probe(stored[:nbytes]) == probe
        and stored[nbytes + 4 :].tobytes() == zarr3.shard_trailer(nbytes)
        and bool(np.array_equal(stored[:nbytes], view))
        and stored[nbytes:].tobytes() == zarr3.shard_end(stored[:nbytes])
    )


def _link(
    located: Source,
    matching: Sequence[Candidate],
    places: dict[str, ocdbt.ValueLocation],
    writer: io.Writer,
    recorded: dict[str, Any],
    context: cp.Context,
) -> int:
    """Links the ``matching`` arrays whose every chunk the source holds in a data file
    that is there (``places``), of the length this save would store it in where that is
    known (by a ``recorded`` of format 1: only where it is), and whose stored
    ``zarr.json`` decodes its chunks as this save's would (``_Decoding``); returns the
    bytes linked. Others are written."""
    old_format = recorded.get("format", _FORMAT) < _FORMAT
    decoding = _Decoding(located, places, context)
    linked = 0
    for c in matching:
        if old_format and c.stored_bytes is None:
            continue
        keys = c.keys
        if all(_as_stored(places.get(key), c.stored_bytes) for key in keys) and decoding(c):
            writer.linked[c.name] = located.linked(keys, places)
            linked += c.nbytes
    return linked


# The members of a zarr.json that say how its stored chunks decode. A record is trusted
# for the chunk shape and codecs it states: a forged one (its _CHECKSUMS rewritten to
# match) could have a save link chunks of another shape or codec, and commit a step that
# cannot load. The source's own zarr.json, which its loads obey, is compared instead.
_DECODING = ("shape", "data_type", "chunk_grid", "chunk_key_encoding", "codecs")
# A zarr.json of ours is a few hundred bytes, inline in the b-tree: a larger one is none.
_MAX_ZARR_JSON_BYTES = 64 << 10


def _metadata_key(name: str) -> str:
    """The key of array ``name``'s ``zarr.json``."""
    return zarr3.array_prefix(name) + "zarr.json"


class _Decoding:
    """Whether the source's ``zarr.json`` of an array decodes its chunks as the one this
    save writes for it would (``_DECODING``): read from the b-tree nodes that place its
    chunks (inline there; no request more, on S3 too), parsed, compared (about 15 us)."""

    def __init__(
        self, located: Source, places: dict[str, ocdbt.ValueLocation], context: cp.Context
    ) -> None:
        self._places = places
        self._located = located
        self._compression = bool(context.array_options.use_compression)
        # Inner chunks (``chunk_byte_size``): exactly those this save's leaf handlers write.
        self._storage = context.array_options.storage_options
        self._expected: dict[tuple[str, str], dict[str, Any]] = {}

    def __call__(self, c: Candidate) -> bool:
        key = _metadata_key(c.name)
        raw = self._located.small_value(key, self._places.get(key), _MAX_ZARR_JSON_BYTES)
        if raw is None:
            return False
        try:
            stored = cp.safe_json.loads(raw, source=key)
        except (ValueError, cp.errors.IntegrityError):
            return False
        if not isinstance(stored, dict):
            return False
        expected = self._expected_of(c)
        return all(stored.get(k) == expected[k] for k in _DECODING)

    def _expected_of(self, c: Candidate) -> dict[str, Any]:
        """The zarr.json this save writes for ``c`` (once per layout)."""
        dtype = np.dtype(c.shards[0][2].dtype)  # bfloat16's signature says only "<V2".
        found = self._expected.get((c.signature, dtype.name))
        if found is None:
            _, shape, _, chunk_shape, *_ = json.loads(c.signature)
            inner = zarr3.inner_chunk_shape(
                chunk_shape, dtype.itemsize, self._storage.chunk_byte_size, self._storage.shard_axes
            )
            found = zarr3.metadata_dict(
                shape, dtype, chunk_shape, inner, compression=self._compression
            )
            self._expected[(c.signature, dtype.name)] = found
        return found


def _as_stored(place: ocdbt.ValueLocation | None, stored_bytes: int | None) -> bool:
    """Whether the source holds a chunk at ``place`` of ``stored_bytes`` (``None``: any
    length; compressed chunks vary). A chunk of another length is of another chunk shape
    (a record that misstates its layout): linking it would commit a step that cannot load."""
    return place is not None and (stored_bytes is None or place.length == stored_bytes)


def _same(earlier: dict[str, Any] | None, now: dict[str, Any]) -> bool:
    """Whether a recorded array has the layout and fingerprints of one saved now."""
    if not earlier:
        return False
    return all(earlier.get(k) == now[k] for k in ("signature", "shards"))


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
