"""The contenders: one small adapter per library, all with the same three calls.

Every adapter's ``save`` returns only once the data is durable (fsynced) or
the library says it is committed, and ``load`` returns a fully materialized
tree (``jax.block_until_ready``), so the times compare like with like.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

__all__ = ["Library", "LeafSpec", "TreeSpec", "Pending", "all_libraries", "tree_spec", "verify"]


class Pending(Protocol):
    """What ``save_async`` returns: ``result()`` waits until the save is committed."""

    def result(self) -> Any:
        """Blocks until the background work finished; re-raises its error."""


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """What the raw and safetensors loaders need to rebuild one leaf."""

    key: str
    shape: tuple[int, ...]
    dtype: np.dtype
    kind: str  # "numpy", "jax", "int" or "float"


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """The structure and leaves of a tree, computed once outside the timed region."""

    treedef: Any
    leaves: tuple[LeafSpec, ...]


def _key_name(entry: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def flatten(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """``([(slash/joined/key, leaf)], treedef)`` for a tree of dicts."""
    import jax

    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [("/".join(_key_name(e) for e in p), leaf) for p, leaf in with_path], treedef


def tree_spec(tree: Any) -> TreeSpec:
    """The ``TreeSpec`` of ``tree``."""
    import jax

    flat, treedef = flatten(tree)
    specs = []
    for key, leaf in flat:
        if isinstance(leaf, bool | int | float):
            kind = "int" if isinstance(leaf, int) else "float"
            arr = np.asarray(leaf)
        else:
            kind = "jax" if isinstance(leaf, jax.Array) else "numpy"
            arr = leaf
        specs.append(LeafSpec(key, tuple(arr.shape), np.dtype(arr.dtype), kind))
    return TreeSpec(treedef, tuple(specs))


def _host(leaf: Any) -> np.ndarray:
    # On the CPU backend np.asarray of a jax.Array is a zero-copy view.
    return np.ascontiguousarray(np.asarray(leaf))


def _fsync(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rebuild_leaf(spec: LeafSpec, arr: np.ndarray) -> Any:
    import jax

    if spec.kind == "jax":
        return jax.device_put(arr)
    if spec.kind in ("int", "float"):
        return arr.item()
    return arr


class Library:
    """A contender. Subclasses implement ``save`` and ``load``; ``save_async`` is optional."""

    name: str = ""
    api: str = ""  # The calls used, for the report.
    returns_jax = True  # Whether jax.Array leaves come back as jax.Array.
    has_async = False

    def unavailable(self) -> str | None:
        """``None`` if the library works here, else why not."""
        return None

    def save(self, path: str, tree: Any, spec: TreeSpec) -> None:
        """Saves durably and returns when done."""
        raise NotImplementedError

    def save_async(self, path: str, tree: Any, spec: TreeSpec) -> Pending:
        """Starts a save; ``result()`` waits for the commit."""
        raise NotImplementedError

    def load(self, path: str, spec: TreeSpec) -> Any:
        """Loads and returns a materialized tree."""
        raise NotImplementedError


class Raw(Library):
    """The floor: the same bytes, leaf after leaf, in one file with one fsync.

    One big file is the strictest floor: on ext4 every extra fsync'd file
    costs a journal commit (~4 ms here), which a one-file-per-leaf baseline
    would charge to "raw" and make ratios look better than they are.
    """

    name = "raw"
    api = (
        "one file for all leaves: np.asarray (zero-copy on CPU), one write per leaf, fsync of "
        "the file and the directory; load = readinto a fresh np.empty per leaf from that file "
        "(page cache), no device_put"
    )
    returns_jax = False
    FILENAME = "data.bin"

    def save(self, path: str, tree: Any, spec: TreeSpec) -> None:
        import jax

        os.makedirs(path)
        with open(os.path.join(path, self.FILENAME), "wb", buffering=0) as f:
            for leaf in jax.tree.leaves(tree):
                view = memoryview(_host(leaf).reshape(-1).view(np.uint8))
                while view:  # write() may be short for huge buffers.
                    view = view[f.write(view) :]
            os.fsync(f.fileno())
        _fsync(path, directory=True)

    def load(self, path: str, spec: TreeSpec) -> Any:
        leaves = []
        with open(os.path.join(path, self.FILENAME), "rb", buffering=0) as f:
            for leaf in spec.leaves:
                arr = np.empty(leaf.shape, leaf.dtype)
                view = memoryview(arr.reshape(-1).view(np.uint8))
                while view:
                    n = f.readinto(view)
                    if not n:
                        raise EOFError(f"{path}/{self.FILENAME} ends before {leaf.key}.")
                    view = view[n:]
                leaves.append(arr)
        return spec.treedef.unflatten(leaves)


class Safetensors(Library):
    """``safetensors.numpy``: one file, keys are slash-joined key paths."""

    name = "safetensors"
    api = (
        "safetensors.numpy.save_file then fsync of the file and directory (jax leaves and "
        "scalars converted with np.asarray first, inside the timing); load_file, then "
        "jax.device_put for jax leaves and .item() for scalars"
    )

    def save(self, path: str, tree: Any, spec: TreeSpec) -> None:
        from safetensors.numpy import save_file

        os.makedirs(path)
        flat, _ = flatten(tree)
        filename = os.path.join(path, "model.safetensors")
        save_file({k: _host(v) for k, v in flat}, filename)
        _fsync(filename)
        _fsync(path, directory=True)

    def load(self, path: str, spec: TreeSpec) -> Any:
        import jax
        from safetensors.numpy import load_file

        arrays = load_file(os.path.join(path, "model.safetensors"))
        leaves = [_rebuild_leaf(leaf, arrays[leaf.key]) for leaf in spec.leaves]
        return jax.block_until_ready(spec.treedef.unflatten(leaves))


class Checkpointables(Library):
    """This library: ``cp.save_pytree`` / ``cp.load_pytree`` / ``cp.save_pytree_async``."""

    name = "checkpointables"
    api = "cp.save_pytree(path, tree), cp.save_pytree_async(...).result(), cp.load_pytree(path)"
    has_async = True

    def unavailable(self) -> str | None:
        try:
            import checkpointables as cp

            with tempfile.TemporaryDirectory(prefix="bench-probe-") as d:
                cp.save_pytree(os.path.join(d, "probe"), {"a": np.arange(3)})
                cp.load_pytree(os.path.join(d, "probe"))
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None

    def save(self, path: str, tree: Any, spec: TreeSpec) -> None:
        import checkpointables as cp

        cp.save_pytree(path, tree)

    def save_async(self, path: str, tree: Any, spec: TreeSpec) -> Pending:
        import checkpointables as cp

        return cp.save_pytree_async(path, tree)

    def load(self, path: str, spec: TreeSpec) -> Any:
        import checkpointables as cp
        import jax

        return jax.block_until_ready(cp.load_pytree(path))


class Orbax(Library):
    """orbax-checkpoint's V1 API with its defaults (zstd, OCDBT, ``state`` subdirectory)."""

    name = "orbax"
    api = (
        "orbax.checkpoint.v1: ocp.save(path, tree), ocp.save_async(...).result(), "
        "ocp.load(path) with no abstract tree; all options at their defaults"
    )
    has_async = True

    def __init__(self) -> None:
        self._quiet = False

    def _ocp(self) -> Any:
        from orbax.checkpoint import v1 as ocp

        if not self._quiet:
            from absl import logging as absl_logging

            absl_logging.set_verbosity(absl_logging.ERROR)
            self._quiet = True
        return ocp

    def unavailable(self) -> str | None:
        try:
            self._ocp()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None

    def save(self, path: str, tree: Any, spec: TreeSpec) -> None:
        self._ocp().save(path, tree)

    def save_async(self, path: str, tree: Any, spec: TreeSpec) -> Pending:
        return self._ocp().save_async(path, tree)

    def load(self, path: str, spec: TreeSpec) -> Any:
        import jax

        with warnings.catch_warnings():
            # Loading without an abstract tree reads shardings from the checkpoint, and says so.
            warnings.filterwarnings("ignore", message="Sharding info not provided")
            return jax.block_until_ready(self._ocp().load(path))


LIBRARIES: dict[str, Callable[[], Library]] = {
    "raw": Raw,
    "checkpointables": Checkpointables,
    "orbax": Orbax,
    "safetensors": Safetensors,
}


def all_libraries(names: list[str] | None = None) -> list[Library]:
    """Fresh adapters for ``names`` (all by default), in report order."""
    chosen = names or list(LIBRARIES)
    unknown = [n for n in chosen if n not in LIBRARIES]
    if unknown:
        raise KeyError(f"Unknown libraries {unknown}; choose from {list(LIBRARIES)}.")
    return [LIBRARIES[n]() for n in LIBRARIES if n in chosen]


def verify(library: Library, loaded: Any, spec: TreeSpec, original: Any) -> None:
    """Raises ``AssertionError`` unless ``loaded`` holds the same keys, kinds and values."""
    import jax

    flat, _ = flatten(loaded)
    keys = [k for k, _ in flat]
    expected = [leaf.key for leaf in spec.leaves]
    if keys != expected:
        missing, extra = set(expected) - set(keys), set(keys) - set(expected)
        raise AssertionError(
            f"{library.name} returned other keys: missing {sorted(missing)[:5]}, "
            f"extra {sorted(extra)[:5]}"
        )
    for (key, got), leaf, want in zip(flat, spec.leaves, jax.tree.leaves(original), strict=True):
        if library.returns_jax and leaf.kind == "jax" and not isinstance(got, jax.Array):
            raise AssertionError(f"{library.name} returned {type(got).__name__} for jax {key}")
        if not np.array_equal(np.asarray(got), np.asarray(want)):
            raise AssertionError(f"{library.name} returned different values for {key}")


def scratch_dir(root: str | None) -> str:
    """A fresh temporary directory under ``root`` (default: the system's, /tmp)."""
    return tempfile.mkdtemp(prefix="checkpointables-bench-", dir=root)


def remove(path: str) -> None:
    """Deletes a benchmark checkpoint (and any sibling temporary directories)."""
    shutil.rmtree(path, ignore_errors=True)
