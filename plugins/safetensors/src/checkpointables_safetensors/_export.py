"""Export: a checkpoint's pytree (or an in-memory pytree) as Hugging Face safetensors.

Tensor names are key paths joined with dots (``{"model": {"layers": [{"w":
...}]}}`` gives ``model.layers.0.w``, as transformers names weights), taken
below ``subtree`` when one is given. Arrays and numeric scalars (as 0-d
tensors) are exported; leaves that are not arrays (strings...) and typed
PRNG keys (RNG state, such as an NNX model's ``rngs``: no weight, and no
safetensors dtype holds one) are skipped and reported; arrays of other dtypes
safetensors cannot store (complex128) are an error naming them. A checkpoint
is read in batches of about ``BATCH_BYTES``, in the order the files are
written, so an export holds at most one batch in memory whatever the model's
size.

Under a host-memory budget (``cp.options.MemoryOptions``) batches are a quarter
of it at most, and a tensor larger than a batch is loaded onto the default
device (the pytree plugin's load streams it there) and written from there in
pieces: the host never holds it whole.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import checkpointables as cp
import jax
import numpy as np

from checkpointables_safetensors import _names
from checkpointables_safetensors._files import code_of
from checkpointables_safetensors._writer import (
    DEFAULT_MAX_SHARD_SIZE,
    Output,
    TensorEntry,
    plan_shards,
    write_safetensors,
)

__all__ = ["ExportResult", "export_checkpoint", "save_pytree", "BATCH_BYTES", "FORMAT_METADATA"]

BATCH_BYTES = 256 << 20
# transformers (and most loaders of the Hub's files) refuse files without a known "format".
FORMAT_METADATA = {"format": "pt"}
# Where `checkpointables import` keeps the source's header metadata, for a later export.
IMPORTED_METADATA_KEY = "safetensors_metadata"


@attrs.frozen
class ExportResult:
    """What an export wrote and what it left out."""

    files: tuple[str, ...]
    tensors: int
    nbytes: int
    skipped: tuple[str, ...]  # Key paths of leaves safetensors cannot hold.


@attrs.frozen
class _Leaf:
    """A leaf of the source tree: where it is, its tensor, and its abstract form for loading."""

    position: int
    entry: TensorEntry
    abstract: Any


def _as_entry(name: str, leaf: Any) -> tuple[TensorEntry, Any] | None:
    """The tensor a leaf (or its metadata) becomes, with an abstract leaf that loads it."""
    if isinstance(leaf, bool | int | float) and not isinstance(leaf, np.generic):
        return TensorEntry(name, (), np.asarray(leaf).dtype), leaf
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or dtype is None or _is_prng_key(dtype):
        return None
    try:
        dtype = np.dtype(dtype)
    except TypeError:  # An extended dtype JAX has besides PRNG keys.
        raise ValueError(f"safetensors cannot store {dtype}") from None
    code_of(dtype)  # Raises ValueError for dtypes it cannot store (complex128...).
    entry = TensorEntry(name, tuple(shape), dtype)
    if isinstance(leaf, np.generic):
        return entry, leaf
    # A NumPy abstract leaf loads to host memory; a zero-strided view costs no memory.
    return entry, np.broadcast_to(np.empty((), dtype), entry.shape)


def _is_prng_key(dtype: Any) -> bool:
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:  # Not a dtype at all: left to np.dtype to refuse.
        return False


# What to do about arrays of dtypes safetensors cannot store, said for each caller.
_CHECKPOINT_ADVICE = (
    "Export a subtree without them (--subtree KEY on the command line, subtree='KEY' in "
    "export_checkpoint), or save a checkpoint with them cast first"
)
_TREE_ADVICE = (
    "Pass a tree without them (for Flax NNX, e.g. nnx.state(model, nnx.Param)), or cast "
    "them first (x.astype(np.float32), or two real arrays for x.real and x.imag)"
)


def _under(leaf: _names.NamedLeaf, prefix: str | None) -> int | None:
    """How many keys of ``leaf``'s path make ``prefix`` (0 for none); ``None``: not under it."""
    if not prefix:
        return 0
    for depth in range(1, len(leaf.keypath) + 1):
        if _names.name_of(leaf.keypath[:depth]) == prefix:
            return depth
    return None


def _relative_name(leaf: _names.NamedLeaf, depth: int) -> str:
    """``leaf``'s tensor name below its first ``depth`` keys; a subtree that is a single leaf
    (or a single NNX Variable) is named by its own key."""
    keys = leaf.keys
    kept_above = sum(1 for i in range(depth) if i != leaf.drop)
    if rest := keys[kept_above:]:
        return _names.SEPARATOR.join(rest)
    return keys[kept_above - 1] if kept_above else _names.name_of(leaf.keypath[depth - 1 : depth])


def _selected(tree: Any, prefix: str | None) -> list[tuple[int, str, _names.NamedLeaf, str]]:
    """The leaves under ``prefix`` with their positions, tensor names (NNX Variables'
    ``value`` keys left out: see ``_names``) and full names (every key below ``prefix``)."""
    every = _names.named_leaves(tree)
    chosen = [(p, leaf, _under(leaf, prefix)) for p, leaf in enumerate(every)]
    chosen = [(p, leaf, depth) for p, leaf, depth in chosen if depth is not None]
    renamed = _names.dict_form([leaf for _, leaf, _ in chosen], every)
    selected = []
    for (position, _, depth), leaf in zip(chosen, renamed, strict=True):
        name = _relative_name(leaf, depth or 0)
        # A one-leaf subtree is named by its own key, whatever it is.
        full = _names.name_of(leaf.keypath[depth or 0 :]) or name
        selected.append((position, name, leaf, full))
    return selected


def _shadowed(shortened: Sequence[tuple[str, str, str]], written: set[str]) -> None:
    """Refuses a leaf named short (``a`` for ``a.value``) beside a tensor named with its full
    key path: a load takes a leaf's full name first, so it would read the other tensor."""
    for shown, name, full in shortened:
        if full in written:
            raise cp.errors.InvalidArgumentError(
                f"The leaf {shown} would be written as {name!r} beside another leaf's tensor "
                f"{full!r}, its own full key path, which a load reads for it first "
                f"(safetensors names must load back into the tree). Rename a key."
            )


def _leaves(tree: Any, prefix: str | None, advice: str) -> tuple[list[_Leaf], list[str], Any, int]:
    """The exportable leaves under ``prefix``, the skipped key paths, the treedef and leaf count.

    Raises:
      cp.errors.InvalidArgumentError: arrays safetensors cannot store (saying ``advice``),
        two leaves of one name, a shortened name beside another leaf's tensor of that
        leaf's full key path (it would not load back), or ``prefix`` selects no leaf
        (``_names.SubtreeNotFoundError``, also a ``KeyError``).
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
    leaves, skipped, unsupported, seen = [], [], [], set()
    shortened: list[tuple[str, str, str]] = []  # Leaves not named by their full key path.
    for position, name, leaf, full in _selected(tree, prefix):
        try:
            found = _as_entry(name, leaf.leaf)
        except ValueError as e:
            unsupported.append(f"{jax.tree_util.keystr(leaf.keypath)} ({e})")
            continue
        if found is None:
            skipped.append(jax.tree_util.keystr(leaf.keypath))
            continue
        if name in seen:
            raise cp.errors.InvalidArgumentError(
                f"Two leaves are both named {name!r} once their keys are joined with dots (a key "
                f"holds a dot); safetensors names must be unique. Rename the key."
            )
        seen.add(name)
        if full != name:
            shortened.append((jax.tree_util.keystr(leaf.keypath), name, full))
        leaves.append(_Leaf(position, *found))
    _shadowed(shortened, seen)
    if unsupported:
        raise cp.errors.InvalidArgumentError(
            f"{len(unsupported)} arrays have dtypes safetensors cannot store: "
            f"{'; '.join(unsupported[:8])}. {advice}."
        )
    if prefix and not leaves and not skipped:
        _names.subtree(tree, prefix)  # Raises SubtreeNotFoundError naming the keys there.
        # Found, yet nothing below it: an empty container, or an empty key ("a.", ".a").
        top = sorted(_names.child_keys(tree))
        raise _names.SubtreeNotFoundError(
            f"The subtree {prefix!r} holds no leaf to export (an empty container, or a key "
            f"path with an empty key: join keys with single dots); the top-level keys are "
            f"{top[:8]}{' ...' if len(top) > 8 else ''}."
        )
    return leaves, skipped, treedef, len(flat)


def _batches(leaves: Sequence[_Leaf], limit: int) -> Iterator[list[_Leaf]]:
    batch: list[_Leaf] = []
    size = 0
    for leaf in leaves:
        if batch and size + leaf.entry.nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(leaf)
        size += leaf.entry.nbytes
    if batch:
        yield batch


def _on_device(leaf: _Leaf, batch_bytes: int, budget: int | None) -> Any:
    """Under a budget, the abstract leaf that loads a tensor larger than a batch onto the
    default device (streamed there, then copied out in pieces: never whole on the host);
    else ``leaf.abstract`` (host memory). Dtypes JAX would narrow stay on the host."""
    entry = leaf.entry
    exact = jax.dtypes.canonicalize_dtype(entry.dtype) == entry.dtype
    if budget is None or entry.nbytes <= batch_bytes or not exact or not entry.shape:
        return leaf.abstract
    return jax.ShapeDtypeStruct(entry.shape, entry.dtype)


def _arrays_from_checkpoint(
    checkpoint: Any, leaves: Sequence[_Leaf], treedef: Any, count: int, batch_bytes: int
) -> Iterator[Any]:
    """Each leaf's array, in order, loading one batch at a time (under a budget, batches of
    a quarter of it at most, and larger tensors as ``jax.Array``s: see ``_on_device``)."""
    budget = cp.context.get_context().memory_options.host_bytes
    if budget is not None:
        batch_bytes = min(batch_bytes, budget // 4)
    for batch in _batches(leaves, batch_bytes):
        abstract = [cp.PLACEHOLDER] * count
        for leaf in batch:
            abstract[leaf.position] = _on_device(leaf, batch_bytes, budget)
        loaded = jax.tree_util.tree_leaves(
            cp.load_pytree(checkpoint, jax.tree_util.tree_unflatten(treedef, abstract)),
            is_leaf=lambda x: x is None,
        )
        for leaf in batch:
            value = loaded[leaf.position]
            yield value if isinstance(value, jax.Array) else np.asarray(value, leaf.entry.dtype)
        del loaded


def _host_or_streamed(value: Any, entry: TensorEntry) -> Any:
    """A leaf of an in-memory tree as written: under a budget a ``jax.Array`` of the entry's
    dtype stays one (copied to the host in pieces), else a host array."""
    budget = cp.context.get_context().memory_options.host_bytes
    if budget is not None and isinstance(value, jax.Array) and value.dtype == entry.dtype:
        return value
    return np.asarray(value, dtype=entry.dtype)


def _plan(
    leaves: Sequence[_Leaf], max_shard_size: int
) -> tuple[list[list[TensorEntry]], list[_Leaf]]:
    """The files to write (``plan_shards``), and the leaves in the order they are written."""
    shards = plan_shards([leaf.entry for leaf in leaves], max_shard_size)
    by_name = {leaf.entry.name: leaf for leaf in leaves}
    return shards, [by_name[e.name] for shard in shards for e in shard]


def export_checkpoint(
    checkpoint: os.PathLike[str] | str,
    out: os.PathLike[str] | str,
    *,
    subtree: str | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
    batch_bytes: int = BATCH_BYTES,
) -> ExportResult:
    """Writes the pytree of ``checkpoint`` (or its ``subtree``, a dotted key path) as safetensors.

    ``out`` is a ``*.safetensors`` path or a directory (then ``model.safetensors``
    in it); above ``max_shard_size`` bytes the data is split into Hub-style
    shards with an index. The header metadata is ``{"format": "pt"}``, the
    metadata a ``checkpointables import`` recorded, and ``metadata``. ``checkpoint``
    may be on an object store; ``out`` is local (files are streamed, fsynced and
    renamed into place): export there, then upload.

    Example::

        export_checkpoint("ckpt/1000", "hf/model.safetensors", subtree="params")

    Raises:
      cp.errors.UnsupportedPathError: ``out`` is a URL (``s3://``...), before any work.
      cp.errors.InvalidArgumentError: ``out`` is named like a file of another kind
        (``out.txt``), or the tree holds arrays of dtypes safetensors cannot store
        (``complex128``; typed PRNG keys are skipped), naming them.
      _names.SubtreeNotFoundError: ``subtree`` selects no leaf (a
        ``cp.errors.InvalidArgumentError``, and a ``KeyError`` as before).
      cp.errors.CheckpointExistsError: an earlier export is at ``out`` and ``overwrite``
        is false.
    """
    output = Output.at(out)  # A URL is refused before any work.
    meta = cp.pytree_metadata(checkpoint)
    leaves, skipped, treedef, count = _leaves(meta.metadata, subtree, _CHECKPOINT_ADVICE)
    shards, leaves = _plan(leaves, max_shard_size)
    imported = (meta.custom_metadata or {}).get(IMPORTED_METADATA_KEY)
    header = {**FORMAT_METADATA, **(imported if isinstance(imported, dict) else {})}
    header.update(metadata or {})
    total = sum(leaf.entry.nbytes for leaf in leaves)
    with cp.progress.bytes_progress(total, "export"):
        files = write_safetensors(
            output,
            shards,
            _arrays_from_checkpoint(checkpoint, leaves, treedef, count, batch_bytes),
            metadata=header,
            overwrite=overwrite,
        )
    return ExportResult(tuple(files), len(leaves), total, tuple(skipped))


def save_pytree(
    out: os.PathLike[str] | str,
    pytree: Any,
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
) -> ExportResult:
    """Writes an in-memory pytree of arrays as safetensors (sharded above ``max_shard_size``),
    at a local ``out`` (a URL raises ``cp.errors.UnsupportedPathError``).

    Example::

        save_pytree("finetuned/", {"model": params})   # finetuned/model.safetensors

    Leaves that are not arrays (strings) and typed PRNG keys (an NNX model's
    ``rngs``) are skipped and listed in the result's ``skipped``.

    Raises:
      cp.errors.InvalidArgumentError: as ``export_checkpoint``.
      cp.errors.CheckpointExistsError: an earlier export is at ``out`` and ``overwrite``
        is false.
    """
    output = Output.at(out)  # A URL is refused before any work.
    leaves, skipped, _, _ = _leaves(pytree, None, _TREE_ADVICE)
    shards, leaves = _plan(leaves, max_shard_size)
    flat = jax.tree_util.tree_leaves(pytree, is_leaf=lambda x: x is None)
    arrays = (_host_or_streamed(flat[leaf.position], leaf.entry) for leaf in leaves)
    files = write_safetensors(
        output,
        shards,
        arrays,
        metadata={**FORMAT_METADATA, **(metadata or {})},
        overwrite=overwrite,
    )
    total = sum(leaf.entry.nbytes for leaf in leaves)
    return ExportResult(tuple(files), len(leaves), total, tuple(skipped))
