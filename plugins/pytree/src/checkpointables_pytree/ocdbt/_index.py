"""Where the values of an OCDBT database are, as its b-tree says.

Reading a value through TensorStore's kvstore costs a future, a thread
hand-over and a fresh ``bytes`` object per key, and an object store a
request per key. The b-tree says where each value is: inline in a leaf node,
or a range of a data file. ``DatabaseIndex.find`` walks from the root to the
nodes that hold the wanted keys, so that values can be read in bulk: by
``_local_reads`` with ``preadv``, by ``_remote_reads`` in few ranged GETs.
Uncompressed nodes (what the manifest's configuration says this library
writes) are decoded by ``_btree_nodes``; compressed ones (Orbax's,
TensorStore's default) by ``ts.ocdbt.dump`` (``_dumps``: at most once per
node, as its results leak), which also reads the manifest.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextvars
import functools
import itertools
import operator
import os
from collections.abc import Collection
from typing import Any, cast

import checkpointables as cp
import numpy as np
import tensorstore as ts
from etils import epath

from checkpointables_pytree import storage
from checkpointables_pytree.ocdbt import _btree_nodes, _context, _node_checksums
from checkpointables_pytree.ocdbt._btree_nodes import parse_location
from checkpointables_pytree.ocdbt._dumps import dump, dump_async
from checkpointables_pytree.storage import ValueLocation

__all__ = [
    "DatabaseIndex",
    "start_node_check",
    "wait_for_node_check",
    "OpenedDatabase",
    "ValueLocation",
    "parse_location",
    "locate",
]

# A pytree whose _METADATA holds more than this (about 100 leaves) has many values:
# its load starts reading the index early (``OpenedDatabase.start``'s ``many_values``).
PREFETCH_METADATA_BYTES = 32 << 10


class DatabaseIndex:
    """The b-tree of one database: read once per load, node by node, as keys are wanted.

    ``prefetch`` starts reading the manifest and the root node on a worker
    thread, so that TensorStore decodes them while the caller plans its reads
    (for 5,000 small arrays the root holds 10,000 entries: about 30 ms, half
    of it in TensorStore's threads). Every ``find`` of one index shares the
    nodes already read.

    Example::

        index = DatabaseIndex(directory)
        index.prefetch()
        found = await index.find(["params.w/c/0/0"])
    """

    def __init__(self, directory: epath.PathLike) -> None:
        self.root = os.fspath(directory)
        self._start: concurrent.futures.Future[tuple[Any, Any]] | None = None
        self._nodes: dict[str, Any] = {}
        self._plain = False  # Whether the manifest says its nodes are uncompressed.
        self._local = _context.is_local(self.root)
        # The nodes checked against the save's _btree_checksums, read once for the check
        # and decoded from these bytes (None: the save recorded none). See ``checked``.
        self._checked: dict[str, bytes] | None = None
        # Without that record: the uncompressed nodes read to bound every node's location
        # (``bound_nodes``), decoded from these bytes too.
        self._bounded: dict[str, bytes] = {}
        self._checking: concurrent.futures.Future[None] = concurrent.futures.Future()

    def prefetch(self) -> None:
        """Starts reading the manifest and the root node in the background (once)."""
        if self._start is None:
            # The caller's context (cp.Context's storage options: endpoint, credentials)
            # must reach the worker thread, as asyncio.to_thread carries it.
            context = contextvars.copy_context()
            self._start = _index_pool().submit(context.run, self._read_root)

    def settle(self) -> None:
        """Waits for the background read ``prefetch`` started, if any, dropping its outcome:
        for a load that fails before it uses the index, so that it raises with nothing of
        its own still reading (a caller may delete or rewrite the directory next)."""
        if self._start is not None:
            concurrent.futures.wait([self._start])

    async def base(self) -> Any:
        """The kvstore of the database's directory (opened once)."""
        self.prefetch()
        assert self._start is not None
        return (await asyncio.wrap_future(self._start))[0]

    def checked(self) -> concurrent.futures.Future[None]:
        """Done once every node the save recorded is checked (``check_recorded_nodes``),
        which the index does first; raises what the check raised. Wait for it before
        TensorStore reads anything of the database: a node the index walks later is then
        one of those checked (or refused, unlisted), and TensorStore's are too."""
        self.prefetch()
        return self._checking

    def check_now(self) -> concurrent.futures.Future[None]:
        """``checked``, with the check made on this thread before returning, unless the
        index has started reading: for a local database of a few nodes, where handing the
        check to a thread costs more than the check (a fifth of a tiny load)."""
        if self._start is None and not self._checking.done():
            try:
                self._checked = _node_checksums.check_recorded_nodes(
                    self.root, bounded=self._bounded
                )
            except BaseException as e:
                self._checking.set_exception(e)
            else:
                self._checking.set_result(None)
        return self._checking

    def _open_and_check(self) -> Any:
        """The base kvstore, once the recorded nodes are checked (``checked``)."""
        if self._checking.done():  # By ``check_now``: raises what it found.
            self._checking.result()
            return _context.open_location(self.root).result()
        try:
            base = _context.open_location(self.root).result()
            self._checked = _node_checksums.check_recorded_nodes(
                self.root, base, bounded=self._bounded
            )
        except BaseException as e:
            self._checking.set_exception(e)
            raise
        self._checking.set_result(None)
        return base

    def _read_root(self) -> tuple[Any, Any]:
        """The base kvstore and the latest root node (``None``: an empty database)."""
        base = self._open_and_check()
        manifest = dump(base, key=self._manifest_key())
        versions = manifest.get("versions") or []
        if not versions:
            return base, None
        # Nodes written without compression are decoded here (_btree_nodes), not by dump.
        self._plain = (manifest.get("config") or {}).get("compression", 0) is None
        latest = max(versions, key=lambda v: v["generation_number"])
        location = latest.get("root", {}).get("location")
        if location is None:  # An empty database.
            return base, None
        _btree_nodes.check_length(self.root, location)
        if self._plain:
            node = _btree_nodes.decoded(self._node_bytes(base, location), location)
            if node is not None:
                return base, (location, node)
        self._refuse_unlisted(location)
        return base, (location, dump(base, location, key=(self.root, location)))

    async def node(self, location: str) -> Any:
        """The node at ``location``: decoded here if it is uncompressed, else by dump."""
        base = await self.base()
        self._refuse_unlisted(location)
        _btree_nodes.check_length(self.root, location)
        if self._plain:
            data = await asyncio.to_thread(self._node_bytes, base, location)
            node = _btree_nodes.decoded(data, location)
            if node is not None:
                return node
        return await dump_async(base, location, key=(self.root, location))

    def _refuse_unlisted(self, location: str) -> None:
        """Raises if the save recorded its nodes and ``location`` is not one of them."""
        if self._checked is not None and location not in self._checked:
            raise _node_checksums.unlisted_node(self.root, location)

    def _manifest_key(self) -> tuple[Any, ...] | None:
        """What identifies the manifest's content (``_node_checksums.manifest_key``)."""
        return _node_checksums.manifest_key(self.root)

    def _node_bytes(self, base: Any, location: str) -> bytes:
        """The bytes of a node (``b""``: missing); a local database's are read directly,
        and those read by the check (against the save's record, or bounding locations)
        are not read again."""
        if self._checked is not None:
            self._refuse_unlisted(location)
            return self._checked[location]
        data = self._bounded.get(location)
        if data is not None:
            return data
        where = parse_location(location, self.root, "btreenode") if self._local else None
        data = None if where is None else storage.read_range(*where)
        if data is None:
            data = _btree_nodes.value_of(_btree_nodes.read(base, location).result())
        return data

    async def find(
        self, keys: Collection[str] | Collection[bytes]
    ) -> dict[bytes, bytes | ValueLocation]:
        """The values of ``keys`` stored inline, and the locations of the others.

        From the latest version of the database. Keys that are missing, or whose
        location cannot be used, are absent from the result. Only the b-tree
        nodes whose key ranges hold one of ``keys`` are read.

        Raises:
          ValueError: TensorStore cannot decode the manifest or a node.
        """
        self.prefetch()
        assert self._start is not None
        _, root = await asyncio.wrap_future(self._start)
        found: dict[bytes, bytes | ValueLocation] = {}
        if root is None:
            return found
        location, node = root
        self._nodes.setdefault(location, node)
        given = frozenset(keys)  # Loads ask for thousands of bytes keys: taken as they are.
        if type(next(iter(given), b"")) is str:
            wanted = frozenset(k.encode() for k in cast("frozenset[str]", given))
        else:
            wanted = cast("frozenset[bytes]", given)
        walk = _Walk(self, self._nodes, wanted, found, self.root)
        await walk.node(location, b"")
        return found


def start_node_check(
    directory: epath.PathLike, index: DatabaseIndex | None = None, *, here: bool = False
) -> concurrent.futures.Future[Any]:
    """Starts checking the b-tree of the database in ``directory`` against what its save
    recorded (``check_recorded_nodes``), on a worker thread; by ``index`` where the load
    has one, which then decodes the nodes checked rather than read them again. ``here``:
    the index checks on this thread, before returning (``DatabaseIndex.check_now``).

    Wait for the result (``wait_for_node_check``) before anything reads the database.
    """
    if index is not None:
        return index.check_now() if here else index.checked()
    context = contextvars.copy_context()  # Storage options reach the worker thread.
    return _index_pool().submit(context.run, _node_checksums.check_recorded_nodes, directory)


async def wait_for_node_check(checking: concurrent.futures.Future[Any]) -> None:
    """Waits for ``start_node_check``'s check; raises what it found.

    Raises:
      cp.errors.IntegrityError: the manifest or a node is not what the save recorded.
      cp.errors.MetadataError: ``_btree_checksums`` is malformed.
    """
    try:
        if checking.done():  # Checked here: no round trip through the event loop.
            checking.result()
        else:
            await asyncio.wrap_future(checking)
    except ValueError as e:
        if isinstance(e, cp.errors.CheckpointError):
            raise
        # TensorStore cannot open the database at all: nothing reads it, and the reads
        # report why, naming the leaf.


@functools.cache
def _index_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpointables-index")


class _Walk:
    """One descent from the root to the leaf nodes that hold the wanted keys."""

    def __init__(
        self,
        index: DatabaseIndex,
        nodes: dict[str, Any],
        wanted: frozenset[bytes],
        found: dict[bytes, bytes | ValueLocation],
        root: str,
    ) -> None:
        self._index = index
        self._nodes = nodes  # Dumps already read, by location (shared by the index's walks).
        self._wanted_set = wanted
        self._sorted: list[bytes] | None = None  # To pick subtrees (none in a one-node tree).
        self._found = found
        self._root = root
        # The nodes this walk reached: a b-tree reaches each node once (a node named twice,
        # or by itself, would be walked again and again).
        self._visited: set[str] = set()
        # Each data file's path is checked once, not once per value.
        self._parse = functools.lru_cache(maxsize=None)(functools.partial(_parse_file, root=root))

    async def node(self, location: str, prefix: bytes, height: int | None = None) -> None:
        """Walks the node at ``location``; its keys are relative to ``prefix`` (the
        ``subtree_common_prefix`` its ancestors' entries share); ``height``: the height
        its parent's implies (``None``: the root).

        Raises:
          cp.errors.IntegrityError: the b-tree reaches a node twice, or a node's height is
            not one less than its parent's (a cycle, or a damaged or forged b-tree).
        """
        if location in self._visited:
            raise _malformed_tree(self._root, location, "the b-tree reaches it twice (a cycle)")
        self._visited.add(location)
        node = self._nodes.get(location)
        if node is None:
            node = self._nodes[location] = await self._index.node(location)
        if height is not None and node["height"] != height:
            raise _malformed_tree(
                self._root,
                location,
                f"it has height {node['height']}, but its parent's entry needs height {height}",
            )
        entries = node["entries"]
        if node["height"] == 0:
            if type(entries) is _btree_nodes.LeafNode:
                self._decoded_leaf(entries, prefix)
            else:
                self._leaf(entries, prefix)
            return
        if self._sorted is None:
            self._sorted = sorted(self._wanted_set)
        wanted = self._sorted
        children = []
        for n, entry in enumerate(entries):
            low = prefix + entry["key"]
            high = prefix + entries[n + 1]["key"] if n + 1 < len(entries) else None
            first = bisect.bisect_left(wanted, low)
            if first < len(wanted) and (high is None or wanted[first] < high):
                child_prefix = prefix + entry.get("subtree_common_prefix", b"")
                children.append(self.node(entry["location"], child_prefix, node["height"] - 1))
        await asyncio.gather(*children)

    def _leaf(self, entries: list[dict[str, Any]], prefix: bytes) -> None:
        wanted, found = self._wanted_set, self._found
        for entry in entries:
            key = prefix + entry["key"] if prefix else entry["key"]
            if key not in wanted:
                continue
            inline = entry.get("inline_value")
            if inline is not None:
                found[key] = inline
                continue
            indirect = entry.get("indirect_value")
            if indirect is None:
                continue
            where, _, numbers = indirect.rpartition(":")
            file, _, offset = where.rpartition(":")
            parsed = self._parse(file)
            if parsed is not None and offset.isdigit() and numbers.isdigit():
                found[key] = ValueLocation(parsed, int(offset), int(numbers))

    def _decoded_leaf(self, node: _btree_nodes.LeafNode, prefix: bytes) -> None:
        # Column by column (a node of 5,000 small arrays holds 10,000 entries), in C loops.
        keys = [prefix + k for k in node.keys] if prefix else node.keys
        chosen = np.flatnonzero(np.fromiter(map(self._wanted_set.__contains__, keys), bool))
        is_inline = node.inline_at[chosen] >= 0
        inline, located = chosen[is_inline], chosen[~is_inline]
        starts, lengths = node.inline_at[inline].tolist(), node.lengths[inline].tolist()
        values = map(node.data.__getitem__, map(slice, starts, map(operator.add, starts, lengths)))
        paths = [self._parse("value:" + f) for f in node.files]
        usable = np.array([p is not None for p in paths], bool)  # Outside: TensorStore's.
        located = located[usable[node.file_ids[located]]]
        files = map(paths.__getitem__, node.file_ids[located].tolist())
        rows = zip(
            files, node.offsets[located].tolist(), node.lengths[located].tolist(), strict=True
        )
        places = map(tuple.__new__, itertools.repeat(ValueLocation), rows)  # No Python frames.
        for picked, found in ((inline, values), (located, places)):
            self._found.update(zip(map(keys.__getitem__, picked.tolist()), found, strict=True))


def _malformed_tree(root: str, location: str, problem: str) -> cp.errors.IntegrityError:
    """The error for a b-tree whose node at ``location`` is not where a b-tree puts one."""
    return storage.integrity_error(
        f"{_node_checksums.node_file(root, location)} (the b-tree node at {location}, "
        f"reached from {os.path.join(root, _context.MANIFEST_FILE)})",
        problem,
    )


def _parse_file(text: str, root: str) -> str | None:
    """The path of ``"value:<base>:<relative>"`` under ``root`` (``None``: another form, or
    outside: see ``parse_location``)."""
    base, colon, relative = text.removeprefix("value:").partition(":")
    if not colon or not text.startswith("value:"):
        return None
    return _btree_nodes.file_inside(root, base, relative)


async def locate(
    directory: epath.PathLike | DatabaseIndex, keys: Collection[str]
) -> dict[str, ValueLocation]:
    """Where the out-of-line values of ``keys`` are (see ``DatabaseIndex.find``)."""
    index = directory if isinstance(directory, DatabaseIndex) else DatabaseIndex(directory)
    found = await index.find(keys)
    return {k.decode(): v for k, v in found.items() if isinstance(v, ValueLocation)}


class OpenedDatabase:
    """A load's TensorStore context and OCDBT kvstore, opened before ``_METADATA`` is parsed.

    For a database of a few values, ``start`` checks the b-tree (``DatabaseIndex.check_now``)
    and issues one read, which brings the
    manifest and the b-tree's root into the context's cache while this thread
    plans the reads (that waiting was a fifth of the load). For one of many
    values (``many_values``) it starts reading where the values are (``index``)
    instead: they are read without the kvstore, whose decoding of the root would
    only take cores.
    """

    def __init__(self, directory: epath.Path, context: ts.Context, kvstore: ts.KvStore) -> None:
        self.context = context
        self.kvstore = kvstore
        self.index = DatabaseIndex(directory)
        self.warming: Any = None  # Held: TensorStore may cancel a dropped read.

    @classmethod
    def start(cls, directory: epath.Path, *, many_values: bool) -> OpenedDatabase | None:
        """Opens the local OCDBT database in ``directory``; ``None`` if there is none.

        ``many_values``: the database holds many values (the caller knows from its own
        files), so the index is prefetched instead of a warming read. Anything unusual
        is left to the reads, which report it.

        Raises:
          cp.errors.MetadataError: the manifest holds more than ``MAX_MANIFEST_BYTES``.
          cp.errors.IntegrityError: (a few values) the b-tree is not what the save
            recorded, or a node's location claims more than a node holds
            (``check_recorded_nodes``); with ``many_values``, the index's check raises it.
        """
        root = os.fspath(directory)
        if not _context.is_local(root) or not os.path.exists(
            os.path.join(root, _context.MANIFEST_FILE)
        ):
            return None
        context = _context.make_context()
        try:
            kvstore = _context.open_kvstore(directory, context).result()
        except cp.errors.CheckpointError:  # A MetadataError is a ValueError: not left.
            raise
        except ValueError:  # TensorStore's errors: the reads report them, naming the leaf.
            return None
        opened = cls(directory, context, kvstore)
        if many_values:  # Its thread checks the b-tree before it or TensorStore reads it.
            opened.index.prefetch()
            return opened
        # The check before the warming read: TensorStore's walk to "" reads nodes below the
        # root, which it reads whole (a forged one can claim gibibytes).
        error = opened.index.check_now().exception()
        if isinstance(error, cp.errors.CheckpointError):
            raise error
        if error is None:  # Else TensorStore cannot open the database: the reads report it.
            opened.warming = kvstore.read("")
        return opened
