"""The SHA-256 of every b-tree node of a saved database: ``_btree_checksums``.

Each node carries a CRC-32C of its own bytes, which anyone who rewrites a node
recomputes: a node rebuilt with the same length can point a key at other
bytes, and both TensorStore and ``decode`` accept it. The nodes live in data
files (``d/...``, or a merged writer's or process's ``.../d/...``), which
``_CHECKSUMS`` does not cover. So once a save's database is final, the
primary host walks its latest b-tree from the manifest and writes the
SHA-256 of every node, by its location as ``ts.ocdbt.dump`` names it, into
``_btree_checksums`` at the top of the pytree directory: a top-level file,
which the commit's ``_CHECKSUMS`` covers. ``checkpointables verify`` walks
the b-tree and compares every node (``node_checksum_problems``); a load
compares every listed node before it reads values (``check_recorded_nodes``).
A database without the file (Orbax's, an older checkpoint's) is read as before,
once every node's location is bounded (``bound_nodes``).

Example::

    record_node_checksums(pytree_directory)  # After the save's last merge.
    listed = read_listed(pytree_directory)  # None: not recorded.
    check_recorded_nodes(pytree_directory)  # Before a load reads values.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
from typing import Any

import checkpointables as cp
import tensorstore as ts
from etils import epath

from checkpointables_pytree import storage
from checkpointables_pytree.ocdbt import _btree_nodes, _context
from checkpointables_pytree.ocdbt._btree_nodes import parse_location
from checkpointables_pytree.ocdbt._dumps import dump, dump_each

__all__ = [
    "NODE_CHECKSUMS_FILE",
    "node_checksums",
    "record_node_checksums",
    "read_listed",
    "check_node",
    "unlisted_node",
    "check_manifest",
    "bound_nodes",
    "check_recorded_nodes",
    "node_checksum_problems",
    "node_file",
]

NODE_CHECKSUMS_FILE = "_btree_checksums"
_FORMAT = 1
# Not a CRC: the CRC-32C of a node that ends in its own valid CRC-32C is the same
# constant for every node (CRC's residue), and any CRC can be matched by a forger who
# changes four more bytes. SHA-256 takes about 2 ms for the 3 MB root of 5,000 arrays.
_ALGORITHM = "sha256"
_HEX = re.compile("[0-9a-f]{64}")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_node(base: ts.KvStore | None, root: str, location: str) -> Any:
    """A future of the node's bytes: read directly from a local file, else by the kvstore
    (``base``, which only an object store's database needs).

    Raises:
      cp.errors.IntegrityError: ``location`` claims more than any node holds.
    """
    _btree_nodes.check_length(root, location)
    if base is None or _context.is_local(root):
        done: concurrent.futures.Future[bytes] = concurrent.futures.Future()
        # A node that cannot be read, or lies outside the database, is read as nothing:
        # its checksum then differs.
        where = parse_location(location, root, "btreenode")
        data = None if where is None else storage.read_range(*where)
        done.set_result(data or b"")
        return done
    return _btree_nodes.read(base, location)


def _children(base: ts.KvStore, root: str, location: str, data: bytes) -> list[str]:
    """The locations of an interior node's children."""
    base_path, _, _, _ = _btree_nodes.split_location(location)
    node = _btree_nodes.decode(data, base_path)
    if node is None:  # Compressed: TensorStore decodes it.
        node = dump(base, location, key=(root, location))["entries"]
    if isinstance(node, _btree_nodes.LeafNode):  # A leaf where the height says interior.
        return []
    return [entry["location"] for entry in node]


def node_checksums(directory: epath.PathLike) -> dict[str, str]:
    """The SHA-256 of every node of the latest b-tree of the database in ``directory``.

    Empty if there is no database or it holds nothing. Reads the nodes one level
    at a time (all of a level at once), and decodes interior nodes only.

    Raises:
      ValueError: TensorStore cannot read the manifest or a node.
      cp.errors.IntegrityError: a node's location claims more than any node holds.
    """
    root = os.fspath(directory)
    if not cp.storage.exists(epath.Path(root) / _context.MANIFEST_FILE):
        return {}
    base = _context.open_location(root).result()
    manifest = ts.ocdbt.dump(base).result()
    versions = manifest.get("versions") or []
    if not versions:
        return {}
    latest = max(versions, key=lambda v: v["generation_number"])
    location = (latest.get("root") or {}).get("location")
    if location is None:
        return {}
    found: dict[str, str] = {}
    level, height = [location], int(latest.get("root_height", 0))
    while level:
        futures = [_read_node(base, root, where) for where in level]
        below: list[str] = []
        for where, future in zip(level, futures, strict=True):
            data = future.result()
            data = data if isinstance(data, bytes) else _btree_nodes.value_of(data)
            found[where] = _digest(data)
            if height > 0:
                below += [c for c in _children(base, root, where, data) if c not in found]
        level, height = list(dict.fromkeys(below)), height - 1
    return found


def record_node_checksums(directory: epath.PathLike) -> None:
    """Writes ``_btree_checksums`` for the database in ``directory`` (nothing if it has none)."""
    found = node_checksums(directory)
    if not found:
        return
    document = {
        "format": _FORMAT,
        "algorithm": _ALGORITHM,
        "nodes": dict(sorted(found.items())),
    }
    cp.storage.write_text(
        epath.Path(directory) / NODE_CHECKSUMS_FILE, json.dumps(document, separators=(",", ":"))
    )


def read_listed(directory: epath.PathLike) -> dict[str, str] | None:
    """The recorded SHA-256 of each node, by location; ``None`` if none were recorded.

    Raises:
      cp.errors.IntegrityError: the file does not match its checksum in ``_CHECKSUMS``.
      cp.errors.MetadataError: the file is malformed.
    """
    path = epath.Path(directory) / NODE_CHECKSUMS_FILE
    try:
        raw = cp.metadata_checksums.read_file(path)
    except FileNotFoundError:
        return None
    document = cp.safe_json.loads(raw, source=path)
    nodes = document.get("nodes") if isinstance(document, dict) else None
    if (
        not isinstance(nodes, dict)
        or document.get("format") != _FORMAT
        or document.get("algorithm") != _ALGORITHM
        or not all(isinstance(v, str) and _HEX.fullmatch(v) for v in nodes.values())
    ):
        raise cp.errors.MetadataError(
            f"{path} is malformed (not a list of b-tree node checksums of format {_FORMAT}); "
            "restore the checkpoint from a copy."
        )
    return {str(where): digest for where, digest in nodes.items()}


def node_file(directory: str, location: str) -> str:
    """The path of the data file that holds the node at ``location`` (``?``: unreadable)."""
    try:
        base, relative, _, _ = _btree_nodes.split_location(location)
    except ValueError:
        return os.path.join(directory, "?")
    return os.path.join(directory, base + relative)


def _mismatch(listed: dict[str, str], directory: str, location: str, digest: str) -> str | None:
    """Why the node at ``location``, of ``digest``, is not the one the save recorded."""
    expected = listed.get(location)
    where = f"{node_file(directory, location)}: the b-tree node at {location}"
    if expected is None:
        return f"{where} is not listed in {NODE_CHECKSUMS_FILE} (the b-tree was changed)"
    if digest != expected:
        return f"{where} does not match its checksum in {NODE_CHECKSUMS_FILE} (damaged or changed)"
    return None


def check_node(listed: dict[str, str] | None, directory: str, location: str, data: bytes) -> None:
    """Raises ``cp.errors.IntegrityError`` (naming the node's file) if the node at
    ``location``, read as ``data``, is not what the save recorded (``listed``:
    ``read_listed``'s; ``None`` checks nothing)."""
    if listed is None:
        return
    problem = _mismatch(listed, directory, location, _digest(data))
    if problem is not None:
        raise cp.errors.IntegrityError(f"{problem}; restore the checkpoint from a copy.")


def unlisted_node(directory: str, location: str) -> cp.errors.IntegrityError:
    """The error for a b-tree that names a node ``_btree_checksums`` does not list."""
    problem = _mismatch({}, directory, location, "")
    return cp.errors.IntegrityError(f"{problem}; restore the checkpoint from a copy.")


def manifest_key(root: str) -> tuple[Any, ...] | None:
    """What identifies a manifest's content, for ``dump``'s cache: a local file's identity,
    size and time (an object store's is not known without a request: ``None``)."""
    if not _context.is_local(root):
        return None
    try:
        stat = os.stat(os.path.join(root, _context.MANIFEST_FILE))
    except OSError:
        return None
    return (root, stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


def check_manifest(directory: epath.PathLike, base: ts.KvStore | None = None) -> dict[str, bytes]:
    """Refuses a manifest TensorStore must not read (``check_manifest_size``), or a b-tree
    node whose location claims more than any node holds (``check_length``), before
    TensorStore reads either: it reads both whole. Every node TensorStore may reach from
    the latest root is bounded (``bound_nodes``). A manifest that cannot be read is left to
    the reads.

    Costs a ``stat`` and the manifest's decoding (once per local manifest: ``dump`` keeps
    it), on an object store the size check's GET and one GET of the manifest; and a read of
    each interior node (none in a tree of one node: a checkpoint of a few arrays).

    Returns the bytes of the uncompressed interior nodes it read, by location.

    Raises:
      cp.errors.MetadataError: the manifest is too large.
      cp.errors.IntegrityError: a node's location claims too many bytes.
    """
    _context.check_manifest_size(directory)
    return bound_nodes(directory, base)


def bound_nodes(directory: epath.PathLike, base: ts.KvStore | None = None) -> dict[str, bytes]:
    """Checks the location of every node of the latest b-tree (``check_length``): the
    root's in the manifest, each child's in its parent, so that no read of the b-tree, by
    TensorStore or the index, asks for more bytes than a node holds. For a database without
    ``_btree_checksums`` (with it, only checked nodes are read, which name only checked
    children).

    Interior nodes are read a level at a time (all of a level at once); leaves are not
    read. Compressed nodes are decoded by ``dump``, whose results the index shares; the
    bytes of uncompressed ones are returned (by location) for the index to decode rather
    than read again. A node that cannot be read or decoded is left to the reads: TensorStore
    cannot read it either, so it reads none of its children.

    Raises:
      cp.errors.IntegrityError: a node's location claims too many bytes.
    """
    root = os.fspath(directory)
    try:
        base = base if base is not None else _context.open_location(root).result()
        manifest = dump(base, key=manifest_key(root))
    except ValueError:
        return {}
    versions = manifest.get("versions") or []
    if not versions:
        return {}
    latest = max(versions, key=lambda v: v.get("generation_number", 0))
    location = (latest.get("root") or {}).get("location")
    if not isinstance(location, str):
        return {}
    _btree_nodes.check_length(root, location)
    plain = (manifest.get("config") or {}).get("compression", 0) is None
    read: dict[str, bytes] = {}
    level, seen, height = [location], {location}, latest.get("root_height", 0)
    while isinstance(height, int) and height > 0 and level:
        below = []
        for child in _child_locations(base, root, level, plain, read):
            _btree_nodes.check_length(root, child)
            if child not in seen:
                seen.add(child)
                below.append(child)
        level, height = below, height - 1
    return read


def _child_locations(
    base: ts.KvStore, root: str, level: list[str], plain: bool, read: dict[str, bytes]
) -> list[str]:
    """The children's locations of the interior nodes at ``level``; the bytes of those
    decoded here (uncompressed) go into ``read``."""
    found: list[str] = []
    compressed = level
    if plain:
        compressed = []
        futures = [_read_node(base, root, where) for where in level]
        for where, future in zip(level, futures, strict=True):
            data = future.result()
            data = data if isinstance(data, bytes) else _btree_nodes.value_of(data)
            try:
                node = _btree_nodes.decoded(data, where)
            except ValueError:
                node = None  # TensorStore's decoding is the judge: dump it.
            if node is None:
                compressed.append(where)
                continue
            read[where] = data
            found += _entry_locations(node)
    keys = [(root, where) for where in compressed]
    for node in dump_each(base, compressed, keys):
        if not isinstance(node, ValueError):
            found += _entry_locations(node)
    return found


def _entry_locations(node: Any) -> list[str]:
    """The child locations a decoded node names (none for a leaf)."""
    entries = node.get("entries") if node.get("height") else None
    if not isinstance(entries, list):
        return []
    return [e["location"] for e in entries if isinstance(e.get("location"), str)]


def check_recorded_nodes(
    directory: epath.PathLike,
    base: ts.KvStore | None = None,
    *,
    bounded: dict[str, bytes] | None = None,
) -> dict[str, bytes] | None:
    """Checks, before a load reads values, that the b-tree is the one the save recorded:
    the manifest against ``_CHECKSUMS`` and every listed node against ``_btree_checksums``.
    Then whatever reads the b-tree (TensorStore or ``DatabaseIndex``) reads only nodes the
    save wrote. Returns the bytes of every node checked, by location, for the index to
    decode rather than read again (``None``: nothing was recorded, nothing checked).

    Without ``_btree_checksums`` (Orbax's, older checkpoints), every node's location is
    bounded instead (``bound_nodes``): the bytes of the uncompressed nodes that reads go
    into ``bounded``, if given, for the index.

    ``base``: the database's kvstore, if the caller has it open (an object store's
    nodes are read through it; a local database's from its files).

    Raises:
      cp.errors.IntegrityError: the manifest or a node differs (naming its file).
      cp.errors.MetadataError: ``_btree_checksums`` is malformed, or the manifest holds
        more than ``MAX_MANIFEST_BYTES`` (``check_manifest_size``).
      cp.errors.IntegrityError: (nothing recorded) a node's location claims too many
        bytes (``bound_nodes``).
    """
    # Before TensorStore (or this check) reads the manifest, whole.
    _context.check_manifest_size(directory)
    listed = read_listed(directory)
    if listed is None:  # Nothing recorded: what TensorStore may read is bounded.
        found = bound_nodes(directory, base)
        if bounded is not None:
            bounded.update(found)
        return None
    root = os.fspath(directory)
    # The manifest names the root node: with it unchanged, unchanged nodes are the tree.
    manifest = epath.Path(root) / _context.MANIFEST_FILE
    try:
        cp.metadata_checksums.read_file(manifest)
    except FileNotFoundError:
        raise cp.errors.IntegrityError(
            f"{manifest} is missing, although {NODE_CHECKSUMS_FILE} lists the nodes of its "
            "database; restore the checkpoint from a copy."
        ) from None
    if base is None and not _context.is_local(root):
        base = _context.open_location(root).result()
    reads = [(where, _read_node(base, root, where)) for where in listed]
    checked = {}
    for where, future in reads:
        data = future.result()
        data = data if isinstance(data, bytes) else _btree_nodes.value_of(data)
        check_node(listed, root, where, data)
        checked[where] = data
    return checked


def node_checksum_problems(directory: epath.PathLike) -> list[str]:
    """Every node of the database in ``directory`` that differs from ``_btree_checksums``:
    changed, not listed, or listed but no longer in the b-tree (empty without the file)."""
    root = os.fspath(directory)
    try:
        listed = read_listed(directory)
    except cp.errors.CheckpointError as e:
        return [str(e)]
    if listed is None:
        return []
    try:
        walked = node_checksums(directory)
    except cp.errors.CheckpointError as e:  # A manifest or node too large to read.
        return [str(e)]
    except ValueError as e:
        return [f"{root}: the b-tree cannot be read ({e}); restore the checkpoint from a copy."]
    found = [_mismatch(listed, root, where, digest) for where, digest in walked.items()]
    for where in listed.keys() - walked.keys():
        found.append(
            f"{node_file(root, where)}: the b-tree node at {where} is listed in "
            f"{NODE_CHECKSUMS_FILE} but the b-tree no longer reaches it (the b-tree was changed)"
        )
    return [p for p in found if p]
