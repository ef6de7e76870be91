"""Merging the pytree directories of a partial-save session into one pytree, without copying data.

``cp.partial.finalize`` moves the pytree directory of every partial save under
the final pytree directory (core names them ``pytree/partial-<seq>/``) and calls
``PyTreeHandler.merge_partial``, which lands here. Each source is a complete
pytree directory as ``PyTreeHandler.save`` wrote it; later sources win:

* a recorded entry (leaf, empty container or ``None``) replaces every entry
  of earlier sources at its key path, above it (a leaf replaced by a
  subtree) or below it (a subtree replaced by a leaf);
* a container whose kind changed (a list saved again as a dict, say) loses
  the earlier entries recorded with the old kind;
* everything else is kept, so ``{"params": {"layer0": ...}}`` followed by
  ``{"params": {"layer1": ...}}`` holds both layers.

The root OCDBT database is built by ``_ocdbt.merge_into``: it only
references the sources' data files. ``_METADATA``, ``_sharding``,
``_strings.json`` and ``array_metadatas/`` are rebuilt from the winning
leaves; other files (written by custom leaf handlers) are hard-linked
(copied on object stores).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import checkpointables as cp
import crc32c
from etils import epath

from checkpointables_pytree import _leaf_distributions, ocdbt
from checkpointables_pytree import tree as tree_room
from checkpointables_pytree.leaves import ARRAY_METADATAS_DIR, STRINGS_FILE, write_text
from checkpointables_pytree.storage import storage_error, write_error

__all__ = ["merge_partial_saves", "plan_merge", "Winner"]

_MANIFEST = "manifest.ocdbt"
_DATA_DIR = "d"
# Files this module rebuilds, and databases it leaves alone: never custom leaf files.
_MANAGED = frozenset(
    {
        tree_room.METADATA_FILE,
        tree_room.SHARDING_FILE,
        STRINGS_FILE,
        ARRAY_METADATAS_DIR,
        _MANIFEST,
        _DATA_DIR,
        # Rebuilt by record_node_checksums, which writes in place: a hard link to the latest
        # source's file would rewrite that source's, which then fails its _CHECKSUMS.
        ocdbt.NODE_CHECKSUMS_FILE,
    }
)
_NAME_BOUNDARIES = frozenset(".-_/")
# _METADATA fields the merged tree computes afresh (the others are the latest source's).
_RECOMPUTED_FIELDS = (
    "format_version",
    "escaped_names",
    "tuples",
    tree_room.INT_KEYS,
    "strings_crc32c",
    "own_value_types",
    _leaf_distributions.FIELD,
)


def _merged_extra(trees: Sequence[tree_room.TreeMetadata]) -> dict[str, Any]:
    """The merged tree's own fields: the last source's, with every source's record of the
    distributions whose leaf handlers wrote its leaves (a leaf may come from any source)."""
    extra = {k: v for k, v in trees[-1].extra.items() if k not in _RECOMPUTED_FIELDS}
    distributions = _leaf_distributions.merged(t.extra for t in trees)
    if distributions:
        extra[_leaf_distributions.FIELD] = distributions
    return extra


@attrs.frozen
class Winner:
    """A recorded entry that survives the merge, and the source it comes from."""

    entry: tree_room.Entry
    source: int


class _Node:
    """A node of the merged tree: the entry recorded here, or children (of one key type)."""

    __slots__ = ("child_key_type", "children", "is_tuple", "winner")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.winner: Winner | None = None
        self.child_key_type: int | None = None
        self.is_tuple = False


def _insert(root: _Node, winner: Winner, tuple_paths: frozenset[tuple[str, ...]]) -> None:
    """Records ``winner``, dropping the earlier entries it replaces.

    The entries of one source never replace each other (none is under another,
    and their containers agree), so only earlier sources' entries are dropped.
    """
    entry = winner.entry
    node = root
    for i, (name, key_type) in enumerate(zip(entry.names, entry.key_types, strict=True)):
        node.winner = None  # A leaf (or empty node) replaced by a subtree.
        if node.child_key_type != key_type:
            node.children = {}  # A container saved again as another kind.
            node.child_key_type = key_type
        node.is_tuple = entry.names[:i] in tuple_paths
        child = node.children.get(name)
        if child is None:
            child = node.children[name] = _Node()
        node = child
    node.winner = winner
    node.children = {}  # A subtree replaced by a leaf (or an empty node).
    node.child_key_type = None


def plan_merge(
    trees: Sequence[tree_room.TreeMetadata],
) -> tuple[dict[tuple[str, ...], Winner], frozenset[tuple[str, ...]]]:
    """The surviving entries (by key names) and the tuple containers of the merged tree.

    ``trees`` are the sources' metadata, oldest first.
    """
    root = _Node()
    for index, tree in enumerate(trees):
        for entry in tree.entries:
            _insert(root, Winner(entry, index), tree.tuple_paths)
    winners: dict[tuple[str, ...], Winner] = {}
    tuples: set[tuple[str, ...]] = set()
    stack: list[tuple[tuple[str, ...], _Node]] = [((), root)]
    while stack:
        path, node = stack.pop()
        if node.winner is not None:
            winners[node.winner.entry.names] = node.winner
        elif node.children:
            if node.is_tuple:
                tuples.add(path)
            stack.extend(((*path, name), child) for name, child in node.children.items())
    # Inner nodes left without any entry below them are not part of the tree.
    inner = {names[:i] for names in winners for i in range(len(names))}
    return winners, frozenset(tuples & inner)


def _int_keys(
    trees: Sequence[tree_room.TreeMetadata], winners: Iterable[Winner]
) -> frozenset[tuple[str, ...]]:
    """The int dict keys of the merged tree: those of the sources' surviving entries."""
    if not any(t.int_keys for t in trees):
        return frozenset()
    found: set[tuple[str, ...]] = set()
    for winner in winners:
        recorded = trees[winner.source].int_keys
        names = winner.entry.names
        found.update(names[:i] for i in range(1, len(names) + 1) if names[:i] in recorded)
    return frozenset(found)


def _read_json(path: epath.Path) -> Any:
    try:
        return json.loads(cp.storage.read_text(path))
    except FileNotFoundError:
        return None


def _link_tree(source: str, target: str) -> None:
    """Hard-links ``source`` (a file or directory) at ``target``; copies where links fail."""
    if not cp.storage.is_local(source):  # An object store: copy each object.
        files = cp.storage.list_files(source) or ([""] if cp.storage.is_file(source) else [])
        for name in files:
            data = cp.storage.read_bytes(f"{source}/{name}" if name else source)
            cp.storage.write_bytes(f"{target}/{name}" if name else target, data)
        return
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
        for name in os.listdir(source):
            _link_tree(os.path.join(source, name), os.path.join(target, name))
        return
    try:
        os.link(source, target)
    except OSError:  # Another file system, or one without hard links.
        shutil.copy2(source, target)


def _owner(name: str, storage_names: Sequence[str]) -> str | None:
    """The storage name a custom leaf file belongs to (the longest one its name starts with)."""
    best = None
    for storage in storage_names:
        matches = name.startswith(storage) and (
            len(name) == len(storage) or name[len(storage)] in _NAME_BOUNDARIES
        )
        if matches and (best is None or len(storage) > len(best)):
            best = storage
    return best


def _custom_files(
    sources: Sequence[epath.Path],
    trees: Sequence[tree_room.TreeMetadata],
    won: Sequence[set[str]],
    target: epath.Path,
) -> None:
    """Links the files custom leaf handlers wrote: the latest source's file of a name wins,
    and a file that belongs to a leaf its source lost is left out."""
    taken: set[str] = set()
    for index in reversed(range(len(sources))):
        directory = sources[index]
        storage_names = [trees[index].storage_name(e.names) for e in trees[index].entries]
        for name in sorted(e.name for e in cp.storage.list_dir(directory)):
            if name in _MANAGED or name.startswith("ocdbt.") or name in taken:
                continue
            owner = _owner(name, storage_names)
            if owner is not None and owner not in won[index]:
                continue
            taken.add(name)
            _link_tree(os.fspath(directory / name), os.fspath(target / name))


def _array_metadatas(
    sources: Sequence[epath.Path], won: Sequence[set[str]], target: epath.Path
) -> None:
    merged: dict[str, list[Any]] = {}
    for directory, names in zip(sources, won, strict=True):
        folder = directory / ARRAY_METADATAS_DIR
        for entry in cp.storage.list_dir(folder):
            file = folder / entry.name
            document = _read_json(file) or {}
            for item in document.get("array_metadatas", []):
                name = (item.get("array_metadata") or {}).get("param_name")
                if name in names:
                    merged.setdefault(file.name, []).append(item)
    if merged:
        cp.storage.make_dirs(target / ARRAY_METADATAS_DIR)
        for file_name, items in merged.items():
            write_text(
                target / ARRAY_METADATAS_DIR / file_name, json.dumps({"array_metadatas": items})
            )


def merge_partial_saves(sources: Sequence[epath.Path], target: epath.Path) -> None:
    """Builds the pytree at ``target`` from the pytree directories ``sources`` (oldest first).

    The sources must be inside ``target`` and stay there: the merged database
    refers to their data files. ``target`` must hold nothing but the sources
    (the caller removes what an interrupted earlier merge left behind).

    Raises:
      ValueError: no sources, or a source outside ``target``.
      cp.errors.MetadataError: a source's ``_METADATA`` is missing or malformed.
      cp.errors.IntegrityError: a source's database is damaged (it names the source).
    """
    if not sources:
        raise ValueError(f"Nothing to merge into {target}: no partial saves were given.")
    sources = [epath.Path(s) for s in sources]
    trees = [tree_room.read_tree_metadata(s) for s in sources]
    winners, tuples = plan_merge(trees)
    merged = tree_room.TreeMetadata(
        entries=sorted((w.entry for w in winners.values()), key=lambda e: e.names),
        tuple_paths=tuples,
        int_keys=_int_keys(trees, winners.values()),
        extra=_merged_extra(trees),
        own_value_types=any(t.own_value_types for t in trees),
    )
    # Storage names each source wins (a name's keys in a database all start with "<name>/").
    won: list[set[str]] = [set() for _ in sources]
    for winner in winners.values():
        if not winner.entry.is_empty_node:
            won[winner.source].add(merged.storage_name(winner.entry.names))
    _merge_databases(sources, trees, won, target)
    _merge_strings_and_shardings(sources, won, target, merged)
    _array_metadatas(sources, won, target)
    _custom_files(sources, trees, won, target)
    # The merged b-tree's nodes (its own file: the sources' stay as their saves recorded them).
    ocdbt.record_node_checksums(target)
    # Last: a pytree directory counts as one once it has _METADATA.
    tree_room.write_tree_metadata(target, merged)


def _merge_databases(
    sources: Sequence[epath.Path],
    trees: Sequence[tree_room.TreeMetadata],
    won: Sequence[set[str]],
    target: epath.Path,
) -> None:
    """Builds the root database from the arrays each source won (referencing their files)."""
    merge_sources = []
    for index, directory in enumerate(sources):
        if not won[index] or not cp.storage.exists(directory / _MANIFEST):
            continue
        stored = {trees[index].storage_name(e.names) for e in trees[index].entries}
        # A source that wins all its leaves is merged whole: one range, not one per leaf.
        prefixes = None if won[index] >= stored else tuple(sorted(f"{n}/" for n in won[index]))
        merge_sources.append(ocdbt.Source(directory, prefixes))
    if not merge_sources:
        return
    try:
        ocdbt.merge_into(target, merge_sources)
    except ValueError as e:
        # storage_error tells damaged or missing bytes (an IntegrityError) from the rest.
        if not isinstance(storage_error(str(target), e), cp.errors.IntegrityError):
            raise write_error(e, f"the merged database in {target}") from e
        raise _damaged_source(sources, target, e) from e


def _damaged_source(
    sources: Sequence[epath.Path], target: epath.Path, error: BaseException
) -> cp.errors.IntegrityError:
    """The error for a source database TensorStore found damaged (or missing a file) while
    merging: it names the partial save whose file failed (TensorStore's text names the file)."""
    text = str(error).replace(os.sep, "/")
    named = [s for s in sources if f"/{s.parent.name}/{s.name}/" in f"/{text}"]
    what = f"the partial save {named[0].parent}" if named else f"a partial save in {target}"
    return cp.errors.IntegrityError(
        f"Cannot merge the partial saves into {target}: {what} is damaged: {error}. Its data "
        f"cannot be published. Restore it from a copy, or delete the partial-save session "
        f"(the directory holding {target}) and make the partial saves again."
    )


def _merge_strings_and_shardings(
    sources: Sequence[epath.Path],
    won: Sequence[set[str]],
    target: epath.Path,
    merged: tree_room.TreeMetadata,
) -> None:
    """Writes ``_strings.json`` (its checksum into ``merged``) and ``_sharding`` of the winners."""
    strings: dict[str, Any] = {}
    shardings: dict[str, dict[str, Any]] = {}
    for index, directory in enumerate(sources):
        if not won[index]:
            continue
        source_strings = _read_json(directory / STRINGS_FILE) or {}
        strings.update({k: v for k, v in source_strings.items() if k in won[index]})
        records = tree_room.read_sharding_file(directory)
        for name in won[index]:
            record = records.get(tree_room.file_key(name))
            if record is not None:
                shardings[name] = record
    if strings:
        text = json.dumps(strings, ensure_ascii=False)
        write_text(target / STRINGS_FILE, text)
        merged.strings_crc32c = crc32c.crc32c(text.encode())
    if shardings:
        tree_room.write_sharding_file(target, shardings)
