"""A local copy's manifest: which files it has (with checksums) and which global shards.

Every copy of a host's local step (on its own disk or a peer's) sits next to
``<writer>.manifest.json``, written only after the copy is complete (its
presence is the copy's commit). It records:

- ``files``: every file of the copy, relative path -> [size, checksum], so a
  copy is checked before it is used and a fetched copy before it is kept;
- ``held``: the global shards (array key, index) the copy holds, and
  ``shards``: every shard of each array, so that completeness of a step is
  decided from data (which shards exist somewhere), not from process ids;
- ``small``: the checkpointables without a ``jax.Array`` (JSON, iterators,
  custom handlers' items), which every host keeps a copy of: a *partial* copy
  (``partial``) holds only them and the copy's top-level files, and no shard;
- ``left``: the copies the save left behind (``Copy``: step, writer, commit
  time): those of steps at or after its own that its host held when it
  started (the run went back; the save removes them), and those such copies
  recorded in turn. A restore never uses a copy some manifest names there,
  whichever host still holds it: the trajectory it belongs to was left. This,
  not the commit times, tells a rollback: commit times come from the clocks
  of different hosts and jobs, and a fast clock in an earlier job would make
  the steps saved after it look older.

Checksums are CRC-32C when the ``crc32c`` module is installed (the pytree
plugin depends on it), else CRC-32 (``zlib``); the manifest names which.

The manifest decides what a restore reads, which copies belong to the run
(``run``) and to its current trajectory (``left``), and which files a host
fetches and removes, so it
is trusted only whole and well formed: it ends with the CRC-32 of everything
before it, framed as ``_CHECKSUMS`` is (``cp.metadata_checksums``), and every
field must have the one form a save writes (``writer`` is
``p<process_index>-of-<process_count>``, file names are relative paths inside
the copy, ...). One that is not raises ``InvalidManifest``; its copy is passed
over. A manifest without its checksum (none was released) is such a one.
So is one that is no regular file (a named pipe, whose ``open()`` would wait
forever for a writer; a device such as ``/dev/zero``) or that holds more than
``MAX_BYTES``: it is refused before a byte is read (``read``). A copy's files are
read the same way (``checksum_file``): a pipe standing in for an empty file
damages its copy, it never hangs the restore.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from checkpointables import errors, storage

__all__ = [
    "Manifest",
    "describe_shards",
    "needed_shards",
    "unsharded_arrays",
    "small_items",
    "uncovered",
    "build",
    "write",
    "read",
    "problems",
    "InvalidManifest",
]

SUFFIX = ".manifest.json"
# The largest manifest read (and written): 256 MiB. Its size grows with the copy's files
# and with ``shards``, every distinct shard of every array (~25 bytes each): 2,000 arrays
# of 4,096 distinct shards each take ~200 MiB. A larger one is damaged or hostile (a sparse
# file of GiBs), and reading it would cost that much memory.
MAX_BYTES = 256 << 20
_CHUNK = 1 << 20
Index = tuple[tuple[int, int], ...]
# One copy of a step, as a manifest names it: (step, writer, commit_timestamp_nsecs). The
# copies of one save (on its host, and its replicas) have the same; another save's differ.
Copy = tuple[int, str, int]
_WRITER = re.compile(r"p(0|[1-9][0-9]*)-of-([1-9][0-9]*)")
_SEAL = re.compile(r'(.*),"checksum":"([0-9a-f]{8})"\}\n?', re.DOTALL)
_ALGORITHMS = ("crc32", "crc32c")


class InvalidManifest(ValueError):
    """A manifest that is damaged or not of the form a save writes: its copy is not used."""


def is_writer_name(writer: str) -> bool:
    """Whether ``writer`` has the form of a copy's name, ``p<index>-of-<count>``
    (``index < count``): nothing else is a copy, and nothing else is ever removed as one."""
    match = _WRITER.fullmatch(writer) if isinstance(writer, str) else None
    return match is not None and int(match.group(1)) < int(match.group(2))


def _crc_function() -> tuple[str, Callable[[bytes, int], int]]:
    try:
        import crc32c

        return "crc32c", lambda data, value: int(crc32c.crc32c(data, value))
    except ImportError:  # The core does not depend on it; CRC-32 detects the same damage.
        return "crc32", zlib.crc32


def updater(algorithm: str) -> Callable[[bytes, int], int]:
    """``update(data, value)`` of the checksum ``algorithm`` names (start from 0).

    Raises:
      ValueError: ``algorithm`` is not available here.
    """
    name, update = _crc_function()
    if algorithm == "crc32":
        return zlib.crc32
    if algorithm != name:
        raise ValueError(f"checksum {algorithm!r} is not available here (pip install crc32c)")
    return update


def checksum_file(path: str, algorithm: str) -> int:
    """The checksum of the file at ``path`` (read in 1 MiB pieces).

    Raises:
      cp.errors.IntegrityError: ``path`` is not a regular file (see
        ``cp.storage.open_regular_file``).
    """
    update = updater(algorithm)
    value = 0
    # Not open(): a named pipe in the copy's place would wait forever (IntegrityError here).
    with os.fdopen(storage.open_regular_file(path), "rb") as f:
        while piece := f.read(_CHUNK):
            value = update(piece, value)
    return value


def _index(index: Iterable[slice], shape: tuple[int, ...]) -> Index:
    return tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(index, shape, strict=True))


def unsharded_arrays(abstract: Mapping[str, Any] | None) -> set[str]:
    """The keys of the arrays of ``abstract`` given without a sharding (a
    ``ShapeDtypeStruct`` without one, a NumPy array): which of their shards this
    process needs is unknown."""
    import jax

    found = set()
    for name, value in (abstract or {}).items():
        for path, leaf in jax.tree_util.tree_leaves_with_path(value):
            if getattr(leaf, "sharding", None) is None and hasattr(leaf, "shape"):
                found.add(f"{name}/{jax.tree_util.keystr(path)}")
    return found


def _array_leaves(checkpointables: Mapping[str, Any]) -> Iterable[tuple[str, Any]]:
    import jax

    for name, value in checkpointables.items():
        for path, leaf in jax.tree_util.tree_leaves_with_path(value):
            if getattr(leaf, "sharding", None) is not None and hasattr(leaf, "shape"):
                yield f"{name}/{jax.tree_util.keystr(path)}", leaf


def describe_shards(
    checkpointables: Mapping[str, Any],
) -> tuple[dict[str, list[Index]], dict[str, list[Index]]]:
    """(held, every): per array key, the shards this process holds, and all shards."""
    held: dict[str, list[Index]] = {}
    every: dict[str, list[Index]] = {}
    for key, leaf in _array_leaves(checkpointables):
        shape = tuple(leaf.shape)
        everything = leaf.sharding.devices_indices_map(shape).values()
        every[key] = sorted({_index(i, shape) for i in everything})
        mine = leaf.sharding.addressable_devices_indices_map(shape).values()
        held[key] = sorted({_index(i, shape) for i in mine})
    return held, every


def small_items(checkpointables: Mapping[str, Any]) -> list[str]:
    """The names of the checkpointables that hold no ``jax.Array`` (every host keeps them)."""
    with_arrays = {key.split("/", 1)[0] for key, _ in _array_leaves(checkpointables)}
    return sorted(n for n in checkpointables if n not in with_arrays)


def needed_shards(abstract: Mapping[str, Any] | None) -> dict[str, set[Index]] | None:
    """Per array key, the shards this process's devices need (``None``: unknown)."""
    if abstract is None:
        return None
    needed: dict[str, set[Index]] = {}
    for key, leaf in _array_leaves(abstract):
        shape = tuple(leaf.shape)
        mine = leaf.sharding.addressable_devices_indices_map(shape).values()
        needed[key] = {_index(i, shape) for i in mine}
    return needed


def _volume(box: Index) -> int:
    size = 1
    for start, stop in box:
        size *= max(stop - start, 0)
    return size


def _overlap(a: Index, b: Index) -> int:
    pairs = zip(a, b, strict=True)
    return _volume(tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in pairs))


def uncovered(needed: Mapping[str, set[Index]], held: Mapping[str, Iterable[Index]]) -> int:
    """How many elements of the shards in ``needed`` no shard in ``held`` holds.

    The shards held, of one save, tile each array (two are equal or disjoint), so
    a needed shard's elements held are the sum of its overlaps with the distinct ones:
    a needed shard may span several held ones (another mesh) or lie in one.
    """
    missing = 0
    for key, boxes in needed.items():
        have: set[Index] = set(held.get(key, ()))
        for box in boxes:
            missing += _volume(box) - sum(_overlap(box, h) for h in have)
    return missing


def _natural(value: Any, what: str, below: int | None = None) -> None:
    """Raises unless ``value`` is an ``int`` (not a ``bool``) >= 0 (and < ``below``)."""
    if type(value) is not int or value < 0 or (below is not None and value >= below):
        bound = "" if below is None else f" below {below}"
        raise InvalidManifest(f"{what} is {value!r}, not a whole number >= 0{bound}")


def _check_file_name(name: Any) -> None:
    """Raises unless ``name`` is a relative path inside the copy ("a/b", never "/a",
    "a/../b", "a//b", "."): a copy's files are written, read and removed by these names."""
    parts = name.split("/") if isinstance(name, str) else [""]
    if any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
        raise InvalidManifest(f"file name {name!r} is not a relative path inside the copy")


def _check_shards(table: Any, what: str) -> None:
    if not isinstance(table, dict):
        raise InvalidManifest(f"{what} is not a table of array keys")
    for key, boxes in table.items():
        if not isinstance(key, str) or not isinstance(boxes, list):
            raise InvalidManifest(f"{what} of {key!r} is not a list of shards")
        for box in boxes:
            if not isinstance(box, tuple) or not all(
                isinstance(pair, tuple) and len(pair) == 2 for pair in box
            ):
                raise InvalidManifest(f"{what} of {key!r} holds {box!r}, not a shard")
            for start, stop in box:
                _natural(start, f"a shard's start in {what} of {key!r}")
                _natural(stop, f"a shard's stop in {what} of {key!r}")


def _check(m: Manifest) -> None:
    """Raises ``InvalidManifest`` unless every field of ``m`` has the form a save writes."""
    _natural(m.step, "step")
    _natural(m.process_count, "process_count")
    if m.process_count == 0:
        raise InvalidManifest("process_count is 0")
    _natural(m.process_index, "process_index", below=m.process_count)
    if m.writer != f"p{m.process_index}-of-{m.process_count}" or not is_writer_name(m.writer):
        raise InvalidManifest(f"writer {m.writer!r} is not p{m.process_index}-of-{m.process_count}")
    if m.algorithm not in _ALGORITHMS:
        raise InvalidManifest(f"algorithm {m.algorithm!r} is none of {_ALGORITHMS}")
    if not isinstance(m.files, dict):
        raise InvalidManifest("files is not a table")
    for name, entry in m.files.items():
        _check_file_name(name)
        if not isinstance(entry, tuple) or len(entry) != 2:
            raise InvalidManifest(f"file {name!r} has {entry!r}, not [size, checksum]")
        _natural(entry[0], f"the size of {name!r}")
        _natural(entry[1], f"the checksum of {name!r}", below=1 << 32)
    _check_shards(m.held, "held")
    _check_shards(m.shards, "shards")
    for key, boxes in m.held.items():
        if not set(boxes) <= set(m.shards.get(key, ())):
            raise InvalidManifest(f"held shards of {key!r} are not among its shards")
    _natural(m.commit_timestamp_nsecs, "commit_timestamp_nsecs")
    if not isinstance(m.metrics, dict) or not isinstance(m.run, str):
        raise InvalidManifest("metrics is not a table, or run is not a string")
    if not isinstance(m.small, list) or not all(isinstance(n, str) for n in m.small):
        raise InvalidManifest("small is not a list of names")
    if not isinstance(m.partial, bool):
        raise InvalidManifest(f"partial is {m.partial!r}, not true or false")
    _check_left(m.left)


def _check_left(left: Any) -> None:
    """Raises unless ``left`` is a list of copies, ``[step, writer, commit time]``."""
    if not isinstance(left, list):
        raise InvalidManifest("left is not a list of copies")
    for entry in left:
        if not isinstance(entry, tuple) or len(entry) != 3 or not is_writer_name(entry[1]):
            raise InvalidManifest(f"left holds {entry!r}, not [step, writer, commit time]")
        _natural(entry[0], "a step in left")
        _natural(entry[2], "a commit time in left")


def _sealed(body: str) -> str:
    return f'{body},"checksum":"{zlib.crc32(body.encode()):08x}"}}'


@attrs.frozen
class Manifest:
    """What one copy of a host's local step holds (see the module's docstring).

    Raises:
      InvalidManifest: a field has a form no save writes.
    """

    step: int
    writer: str
    process_index: int
    process_count: int
    algorithm: str
    files: dict[str, tuple[int, int]]
    held: dict[str, list[Index]]
    shards: dict[str, list[Index]]
    metrics: dict[str, Any] = attrs.field(factory=dict)
    commit_timestamp_nsecs: int = 0
    small: list[str] = attrs.field(factory=list)
    partial: bool = False
    # The run it belongs to: the persistent root its local directory's record names.
    run: str = ""
    # The copies this save left behind (see the module's docstring); none in manifests
    # written before it was recorded.
    left: list[Copy] = attrs.field(factory=list)

    def __attrs_post_init__(self) -> None:
        _check(self)

    @property
    def copy(self) -> Copy:
        """Which copy this is, as a manifest's ``left`` names it."""
        return (self.step, self.writer, self.commit_timestamp_nsecs)

    def small_part(self) -> Manifest:
        """The manifest of this copy's small part, which every host keeps: its top-level
        files and its ``small`` checkpointables (those without a ``jax.Array``: JSON,
        dataset iterators, custom handlers' items). It holds no shard."""
        files = {
            k: v for k, v in self.files.items() if "/" not in k or k.split("/")[0] in self.small
        }
        return attrs.evolve(self, files=files, held={}, partial=True)

    @property
    def nbytes(self) -> int:
        """The copy's size: the sum of its files' sizes."""
        return sum(size for size, _ in self.files.values())

    def to_json(self) -> str:
        """The manifest as compact JSON, ending with the CRC-32 of what precedes it."""
        body = json.dumps(attrs.asdict(self), separators=(",", ":"), sort_keys=True)
        return _sealed(body[:-1])

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """The manifest ``to_json`` wrote.

        Raises:
          InvalidManifest: ``text`` is damaged (its checksum differs), has no checksum,
            or is not a manifest of the form a save writes.
        """
        match = _SEAL.fullmatch(text)
        if match is None:
            raise InvalidManifest("it does not end with its checksum")
        if zlib.crc32(match.group(1).encode()) != int(match.group(2), 16):
            raise InvalidManifest("it is damaged: it does not match its checksum")
        try:
            raw = json.loads(text)
            del raw["checksum"]

            def shards(d: dict[str, list[Any]]) -> dict[str, list[Index]]:
                return {k: [tuple(tuple(p) for p in i) for i in v] for k, v in d.items()}

            raw["files"] = {k: tuple(v) for k, v in raw["files"].items()}
            raw["held"] = shards(raw["held"])
            raw["shards"] = shards(raw["shards"])
            if isinstance(raw.get("left"), list):  # Entries of another form: refused.
                raw["left"] = [tuple(e) if isinstance(e, list) else e for e in raw["left"]]
            return cls(**raw)
        except InvalidManifest:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise InvalidManifest(f"it is not a manifest: {type(e).__name__}: {e}") from None


def build(copy_dir: str, step: int, writer: str, **fields: Any) -> Manifest:
    """The manifest of the finished copy at ``copy_dir`` (reads every file once)."""
    algorithm, _ = _crc_function()
    files: dict[str, tuple[int, int]] = {}
    for parent, _dirs, names in os.walk(copy_dir):
        for name in names:
            path = os.path.join(parent, name)
            relative = os.path.relpath(path, copy_dir).replace(os.sep, "/")
            files[relative] = (os.path.getsize(path), checksum_file(path, algorithm))
    return Manifest(
        step=step,
        writer=writer,
        algorithm=algorithm,
        files=files,
        commit_timestamp_nsecs=time.time_ns(),
        **fields,
    )


def write(manifest: Manifest, path: str) -> None:
    """Writes ``manifest`` to ``path`` atomically and durably (the copy's commit).

    Raises:
      InvalidManifest: it is larger than ``MAX_BYTES`` (``read`` would refuse it).
    """
    text = manifest.to_json()
    if len(text) > MAX_BYTES:
        raise InvalidManifest(
            f"the manifest of {path} would hold {len(text):,} bytes, more than the "
            f"{MAX_BYTES:,} a manifest is read up to: the copy has too many files or shards "
            f"for the local tier"
        )
    tmp = f"{path}.tmp-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)  # What a killed write left (it may be anything): never written into.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read(path: str) -> Manifest | None:
    """The manifest at ``path``, or ``None`` if it is missing.

    Raises:
      InvalidManifest: it is unreadable, damaged or malformed, no regular file, or
        larger than ``MAX_BYTES`` (the message names it); nothing is read from one
        that is no regular file or too large.
    """
    try:
        text = storage.read_bytes(path, max_bytes=MAX_BYTES).decode("utf-8")
        return Manifest.from_json(text)
    except FileNotFoundError:
        return None
    except InvalidManifest as e:
        raise InvalidManifest(f"{path}: {e}") from None
    # UnicodeDecodeError is a ValueError; IntegrityError: a pipe, a device, a directory;
    # MetadataError: larger than MAX_BYTES.
    except (OSError, ValueError, errors.IntegrityError, errors.MetadataError) as e:
        raise InvalidManifest(f"{path} is unreadable: {e}") from None


def problems(copy_dir: str, manifest: Manifest) -> list[str]:
    """What is wrong with the copy at ``copy_dir`` (empty: every file matches its checksum)."""
    found: list[str] = []
    for relative, (size, crc) in manifest.files.items():
        path = os.path.join(copy_dir, relative)
        try:
            if os.path.getsize(path) != size:
                found.append(f"{relative}: size differs from {size}")
            elif checksum_file(path, manifest.algorithm) != crc:
                found.append(f"{relative}: {manifest.algorithm} mismatch")
        except (OSError, ValueError, errors.IntegrityError) as e:
            found.append(f"{relative}: {e}")
    return found
