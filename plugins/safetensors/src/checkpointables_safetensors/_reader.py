"""``SafetensorsReader``: ``cp.load_pytree`` and ``cp.pytree_metadata`` of safetensors paths.

Registered through the core's ``register_pytree_readers`` hook, so the core
asks it about any path that is not a checkpoint directory.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import checkpointables as cp
import jax
import numpy as np
from etils import epath

from checkpointables_safetensors import _files, _names
from checkpointables_safetensors._reads import ArrayRead, Limits, read_all

__all__ = ["SafetensorsReader", "LoadPlan", "plan_load"]

# Abstract leaves (types or values) that ask for a scalar of their type.
_SCALAR_TYPES = (bool, int, float, np.generic)
_SHOWN = 8  # Key paths named in an error message.


@attrs.frozen
class LoadPlan:
    """The reads a load makes, and how their results become the pytree."""

    reads: Sequence[ArrayRead]
    build: Callable[[list[Any]], Any]


def _listing(names: Sequence[str]) -> str:
    shown = sorted(names)[:_SHOWN]
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return f"{shown}{more}"


def _read_for(keypath: str, tensor: _files.StoredTensor, abstract: Any) -> ArrayRead:
    """What the abstract leaf ``abstract`` asks of ``tensor``."""
    is_scalar_type = isinstance(abstract, type) and issubclass(abstract, _SCALAR_TYPES)
    if is_scalar_type or isinstance(abstract, _SCALAR_TYPES):
        scalar_type = abstract if isinstance(abstract, type) else type(abstract)
        if int(np.prod(tensor.shape)) != 1:
            raise cp.errors.TreeMismatchError(
                f"{keypath}: the abstract tree asks for a {scalar_type.__name__}, but the tensor "
                f"{tensor.name!r} has shape {tensor.shape}."
            )
        return ArrayRead(tensor, tensor.dtype, to_jax=False, to_scalar=scalar_type)
    shape, dtype = getattr(abstract, "shape", None), getattr(abstract, "dtype", None)
    if shape is None or dtype is None:
        raise cp.errors.InvalidArgumentTypeError(
            f"{keypath}: abstract leaves for safetensors data are jax.ShapeDtypeStruct, "
            f"np.ndarray, int, float, bool, None or cp.PLACEHOLDER; got {type(abstract).__name__}."
        )
    if tuple(shape) != tensor.shape:
        raise cp.errors.TreeMismatchError(
            f"{keypath}: the abstract tree asks for shape {tuple(shape)}, but the tensor "
            f"{tensor.name!r} in {tensor.file} has shape {tensor.shape}."
        )
    if isinstance(abstract, np.ndarray):
        return ArrayRead(tensor, abstract.dtype, to_jax=False)
    return ArrayRead(tensor, np.dtype(dtype), sharding=getattr(abstract, "sharding", None))


def _two_leaves(
    tensor_set: _files.TensorSet, name: str, first: str, second: str
) -> cp.errors.TreeMismatchError:
    return cp.errors.TreeMismatchError(
        f"The abstract tree's leaves {first} and {second} both name the tensor {name!r} of "
        f"{tensor_set.source} once their keys are joined with '.' (a key holds a dot); a tensor "
        f"loads into one leaf. Rename the key, or skip one of them with None."
    )


def plan_load(tensor_set: _files.TensorSet, abstract: Any, *, partial_load: bool) -> LoadPlan:
    """Matches ``abstract`` (or, for ``None``, every tensor) with the tensors of ``tensor_set``.

    Raises:
      cp.errors.TreeMismatchError: a leaf has no tensor, or a shape differs, or two
        leaves name one tensor, or (without ``partial_load``) tensors are left out; the
        message names them.
    """
    tensors = tensor_set.tensors
    if abstract is None:
        names = list(tensors)
        reads = [ArrayRead.as_stored(tensors[n]) for n in names]
        source = tensor_set.source
        return LoadPlan(
            reads, lambda values: _names.nest(dict(zip(names, values, strict=True)), source=source)
        )
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=lambda x: x is None)
    # Flax NNX Variables' `.value` is no part of a name; files exported with it still load.
    names = _names.tensor_names(abstract, tensors)
    leaves: list[Any] = [leaf for _, leaf in flat]
    reads, positions, mentioned, missing = [], [], set(), []
    readers: dict[str, str] = {}  # Tensor name -> the key path of the leaf that reads it.
    for position, (keypath, leaf) in enumerate(flat):
        name = names[position]
        mentioned.add(name)
        if leaf is None or leaf is cp.PLACEHOLDER:
            continue
        shown = jax.tree_util.keystr(keypath)
        if name in readers:  # {"a.b": x, "a": {"b": y}}: which leaf the tensor is for?
            raise _two_leaves(tensor_set, name, readers[name], shown)
        readers[name] = shown
        if name not in tensors:
            missing.append(name)
            continue
        reads.append(_read_for(shown, tensors[name], leaf))
        positions.append(position)
    if missing:
        raise cp.errors.TreeMismatchError(
            f"{tensor_set.source} has no tensor for {len(missing)} leaves of the abstract tree: "
            f"{_listing(missing)} (names are key paths joined with '.', less a Flax NNX "
            f"Variable's '.value'). It holds "
            f"{_listing(list(tensors))}."
        )
    left_out = [n for n in tensors if n not in mentioned]
    if left_out and not partial_load:
        raise cp.errors.TreeMismatchError(
            f"The abstract tree leaves out {len(left_out)} tensors of {tensor_set.source}: "
            f"{_listing(left_out)}. Pass partial_load=True to load only the leaves it names."
        )

    def build(values: list[Any]) -> Any:
        result = list(leaves)
        for position, value in zip(positions, values, strict=True):
            result[position] = value
        return jax.tree_util.tree_unflatten(treedef, result)

    return LoadPlan(reads, build)


def abstract_tree(tensor_set: _files.TensorSet) -> dict[str, Any]:
    """The nested dict of ``jax.ShapeDtypeStruct`` describing every tensor."""
    return _names.nest(
        {n: jax.ShapeDtypeStruct(t.shape, t.dtype) for n, t in tensor_set.tensors.items()},
        source=tensor_set.source,
    )


class SafetensorsReader:
    """Reads Hugging Face safetensors data as pytrees: a file, an index, or a directory.

    Used through the free functions, never directly::

        params = cp.load_pytree("model.safetensors")            # nested dicts of jax.Array
        abstract = cp.pytree_metadata("llama/").metadata          # shapes and dtypes only
        params = cp.load_pytree("llama/", sharded_abstract)       # straight onto a mesh
    """

    def recognizes(self, path: epath.Path) -> bool:
        """True for ``*.safetensors`` files, indexes, and directories holding them."""
        return _files.recognizes(path)

    async def load(self, path: epath.Path, abstract_pytree: Any = None) -> Awaitable[Any]:
        """Reads the headers and plans now; returns the awaitable that reads the data."""
        tensor_set = _files.open_tensor_set(path)
        partial = cp.context.get_context().pytree_options.partial_load
        plan = plan_load(tensor_set, abstract_pytree, partial_load=partial)
        limits = Limits.in_context()  # The budget (cp.options.MemoryOptions), if any.

        async def read() -> Any:
            return plan.build(read_all(plan.reads, limits))

        return read()

    async def metadata(self, path: epath.Path) -> cp.CheckpointMetadata[Any]:
        """Shapes and dtypes from the headers (no data read); the files' metadata as custom."""
        tensor_set = _files.open_tensor_set(path)
        return cp.CheckpointMetadata(
            path, metadata=abstract_tree(tensor_set), custom_metadata=tensor_set.metadata
        )
