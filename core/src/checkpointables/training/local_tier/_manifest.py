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
  (``partial``) holds only them and the copy's top-level files, and no shard.

Checksums are CRC-32C when the ``crc32c`` module is installed (the pytree
plugin depends on it), else CRC-32 (``zlib``); the manifest names which.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

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
]

SUFFIX = ".manifest.json"
_CHUNK = 1 << 20
Index = tuple[tuple[int, int], ...]


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
    """The checksum of the file at ``path`` (read in 1 MiB pieces)."""
    update = updater(algorithm)
    value = 0
    with open(path, "rb") as f:
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


@attrs.frozen
class Manifest:
    """What one copy of a host's local step holds (see the module's docstring)."""

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
        """The manifest as compact JSON."""
        return json.dumps(attrs.asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """The manifest ``to_json`` wrote."""
        raw = json.loads(text)

        def shards(d: dict[str, list[Any]]) -> dict[str, list[Index]]:
            return {k: [tuple((int(a), int(b)) for a, b in i) for i in v] for k, v in d.items()}

        raw["files"] = {k: (int(v[0]), int(v[1])) for k, v in raw["files"].items()}
        raw["held"] = shards(raw["held"])
        raw["shards"] = shards(raw["shards"])
        return cls(**raw)


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
    """Writes ``manifest`` to ``path`` atomically and durably (the copy's commit)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read(path: str) -> Manifest | None:
    """The manifest at ``path``, or ``None`` if it is missing or unreadable."""
    try:
        with open(path) as f:
            return Manifest.from_json(f.read())
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
        except (OSError, ValueError) as e:
            found.append(f"{relative}: {e}")
    return found
