"""The CRC-32C of every b-tree node of a saved database: ``_btree_checksums``.

Each node carries a CRC-32C of its own bytes, which anyone who rewrites a node
recomputes: a node rebuilt with the same length can point a key at other
bytes, and both TensorStore and ``decode`` accept it. The nodes live in data
files (``d/...``, or a merged writer's or process's ``.../d/...``), which
``_CHECKSUMS`` does not cover. So once a save's database is final, the
primary host walks its latest b-tree from the manifest and writes the
CRC-32C of every node, by its location as ``ts.ocdbt.dump`` names it, into
``_btree_checksums`` at the top of the pytree directory: a top-level file,
which the commit's ``_CHECKSUMS`` covers. ``checkpointables verify`` walks
the b-tree and compares every node (``node_checksum_problems``); a load's index compares
each node it reads (``check_node``). A database without the file (Orbax's,
an older checkpoint's) is read as before.

Example::

    record_node_checksums(pytree_directory)  # After the save's last merge.
    listed = read_listed(pytree_directory)  # None: not recorded.
    check_node(listed, pytree_directory, location, node_bytes)
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from typing import Any

import checkpointables as cp
import crc32c
import tensorstore as ts
from etils import epath

from checkpointables_pytree import storage
from checkpointables_pytree.ocdbt import _btree_nodes, _context
from checkpointables_pytree.ocdbt._dumps import dump

__all__ = [
    "NODE_CHECKSUMS_FILE",
    "node_checksums",
    "record_node_checksums",
    "read_listed",
    "check_node",
    "node_checksum_problems",
]

NODE_CHECKSUMS_FILE = "_btree_checksums"
_FORMAT = 1


def _read_node(base: ts.KvStore, root: str, location: str) -> Any:
    """A future of the node's bytes: read directly from a local file, else by the kvstore."""
    if _context.is_local(root):
        try:
            where = _btree_nodes.split_location(location)
        except ValueError:
            where = None
        if where is not None:
            path = os.path.normpath(os.path.join(root, where[0] + where[1]))
            inside = os.path.commonpath([path, os.path.normpath(root)]) == os.path.normpath(root)
            done: concurrent.futures.Future[bytes] = concurrent.futures.Future()
            # A node outside the database is read as nothing: its checksum then differs.
            data = storage.read_range(path, where[2], where[3]) if inside else None
            done.set_result(data or b"")
            return done
    return _btree_nodes.read(base, location)


def _children(base: ts.KvStore, root: str, location: str, data: bytes) -> list[str]:
    """The locations of an interior node's children."""
    base_path, _, _, _ = _btree_nodes.split_location(location)
    node = _btree_nodes.decode(data, base_path)
    if node is None:  # Compressed: TensorStore decodes it.
        node = dump(base, location, key=(root, location))["entries"]
    return [entry["location"] for entry in node]


def node_checksums(directory: epath.PathLike) -> dict[str, int]:
    """The CRC-32C of every node of the latest b-tree of the database in ``directory``.

    Empty if there is no database or it holds nothing. Reads the nodes one level
    at a time (all of a level at once), and decodes interior nodes only.

    Raises:
      ValueError: TensorStore cannot read the manifest or a node.
    """
    root = os.fspath(directory)
    if not cp.storage.exists(epath.Path(root) / _context.MANIFEST_FILE):
        return {}
    base = ts.KvStore.open(_context.location_spec(root)).result()
    manifest = ts.ocdbt.dump(base).result()
    versions = manifest.get("versions") or []
    if not versions:
        return {}
    latest = max(versions, key=lambda v: v["generation_number"])
    location = (latest.get("root") or {}).get("location")
    if location is None:
        return {}
    found: dict[str, int] = {}
    level, height = [location], int(latest.get("root_height", 0))
    while level:
        futures = [_read_node(base, root, where) for where in level]
        below: list[str] = []
        for where, future in zip(level, futures, strict=True):
            data = future.result()
            data = data if isinstance(data, bytes) else _btree_nodes.value_of(data)
            found[where] = crc32c.crc32c(data)
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
        "algorithm": "crc32c",
        "nodes": {where: f"{crc:08x}" for where, crc in sorted(found.items())},
    }
    cp.storage.write_text(
        epath.Path(directory) / NODE_CHECKSUMS_FILE, json.dumps(document, separators=(",", ":"))
    )


def read_listed(directory: epath.PathLike) -> dict[str, int] | None:
    """The recorded CRC-32C of each node, by location; ``None`` if none were recorded.

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
        or not all(isinstance(v, str) and len(v) == 8 for v in nodes.values())
    ):
        raise cp.errors.MetadataError(
            f"{path} is malformed (not a list of b-tree node checksums of format {_FORMAT}); "
            "restore the checkpoint from a copy."
        )
    try:
        return {str(where): int(crc, 16) for where, crc in nodes.items()}
    except ValueError:
        raise cp.errors.MetadataError(
            f"{path} is malformed (a checksum is not hexadecimal); restore the checkpoint "
            "from a copy."
        ) from None


def _node_file(directory: str, location: str) -> str:
    try:
        base, relative, _, _ = _btree_nodes.split_location(location)
    except ValueError:
        return os.path.join(directory, "?")
    return os.path.join(directory, base + relative)


def _mismatch(listed: dict[str, int], directory: str, location: str, crc: int) -> str | None:
    """Why the node at ``location``, of CRC-32C ``crc``, is not the one the save recorded."""
    expected = listed.get(location)
    where = f"{_node_file(directory, location)}: the b-tree node at {location}"
    if expected is None:
        return f"{where} is not listed in {NODE_CHECKSUMS_FILE} (the b-tree was changed)"
    if crc != expected:
        return f"{where} does not match its checksum in {NODE_CHECKSUMS_FILE} (damaged or changed)"
    return None


def check_node(listed: dict[str, int] | None, directory: str, location: str, data: bytes) -> None:
    """Raises ``cp.errors.IntegrityError`` (naming the node's file) if the node at
    ``location``, read as ``data``, is not what the save recorded (``listed``:
    ``read_listed``'s; ``None`` checks nothing)."""
    if listed is None:
        return
    problem = _mismatch(listed, directory, location, crc32c.crc32c(data))
    if problem is not None:
        raise cp.errors.IntegrityError(f"{problem}; restore the checkpoint from a copy.")


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
    except ValueError as e:
        return [f"{root}: the b-tree cannot be read ({e}); restore the checkpoint from a copy."]
    found = [_mismatch(listed, root, where, crc) for where, crc in walked.items()]
    for where in listed.keys() - walked.keys():
        found.append(
            f"{_node_file(root, where)}: the b-tree node at {where} is listed in "
            f"{NODE_CHECKSUMS_FILE} but the b-tree no longer reaches it (the b-tree was changed)"
        )
    return [p for p in found if p]
