"""The ``LeafHandler`` protocol and what it is called with."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Sequence
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from etils import epath

from checkpointables.path import PathAwaitingCreation

Leaf = TypeVar("Leaf")
AbstractLeaf = TypeVar("AbstractLeaf")


@functools.lru_cache(maxsize=1 << 16)  # Trees repeat their key names: escape each once.
def _escape_key(key: str) -> str:
    # '.' joins keys and '/' separates directories: escaping them keeps
    # {"a.b": x} apart from {"a": {"b": y}} and keeps every name inside the
    # checkpoint. Names without these characters are Orbax's names exactly.
    return key.replace("%", "%25").replace(".", "%2E").replace("/", "%2F").replace("\\", "%5C")


def key_name(key: Any) -> str:
    """The string form of one ``jax.tree_util`` key entry (or a plain string/int)."""
    if type(key) is str:
        return key
    for attribute in ("key", "idx", "name"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def param_name_from_keypath(keypath: Sequence[Any]) -> str:
    """The storage name of a leaf: its escaped keys joined by ``.``.

    Example: ``("params", "layer0", "kernel")`` -> ``"params.layer0.kernel"``;
    ``("a.b",)`` -> ``"a%2Eb"``.
    """
    # A list, not a generator: join is faster on one (this runs once per leaf).
    return ".".join([_escape_key(k if type(k) is str else key_name(k)) for k in keypath])


@dataclasses.dataclass(frozen=True)
class SerializationParam(Generic[Leaf]):
    """One leaf to save: its key path in the tree and its value."""

    keypath: tuple[Any, ...]
    value: Leaf

    @property
    def name(self) -> str:
        """A storage name unique within the tree and safe as a file name."""
        return param_name_from_keypath(self.keypath)


@dataclasses.dataclass(frozen=True)
class DeserializationParam(Generic[AbstractLeaf]):
    """One leaf to load: its key path and the abstract leaf (or ``None``: as saved)."""

    keypath: tuple[Any, ...]
    value: AbstractLeaf | type[AbstractLeaf] | None = None

    @property
    def name(self) -> str:
        """The storage name the leaf was saved under."""
        return param_name_from_keypath(self.keypath)


@dataclasses.dataclass(frozen=True)
class SerializationContext:
    """Where and with what the leaves of one save are written.

    Attributes:
      parent_dir: the pytree's directory, being created in the background.
      ts_context: the TensorStore context shared by the save, if any.
      byte_limiter: limits bytes in flight, if any.
    """

    parent_dir: PathAwaitingCreation
    ts_context: Any = None
    byte_limiter: Any = None


@dataclasses.dataclass(frozen=True)
class DeserializationContext:
    """Where and with what the leaves of one load are read.

    Attributes:
      parent_dir: the pytree's directory.
      ocdbt_checkpoint: whether arrays live in an OCDBT database.
      zarr3_checkpoint: whether arrays are zarr v3 (else v2).
      ts_context: the TensorStore context shared by the load, if any.
      byte_limiter: limits bytes in flight, if any.
    """

    parent_dir: epath.Path
    ocdbt_checkpoint: bool = True
    zarr3_checkpoint: bool = True
    ts_context: Any = None
    byte_limiter: Any = None


@runtime_checkable
class LeafHandler(Protocol[Leaf, AbstractLeaf]):
    """Saves and loads every leaf of one type in a pytree, in batches.

    The constructor takes ``context=None`` (a ``cp.Context``). As with
    checkpointable handlers, each coroutine is the blocking phase and the
    awaitable it returns is the background phase.
    """

    async def serialize(
        self,
        params: Sequence[SerializationParam[Leaf]],
        serialization_context: SerializationContext,
    ) -> Awaitable[None]:
        """Snapshots the leaves; returns the awaitable that writes them."""
        ...

    async def deserialize(
        self,
        params: Sequence[DeserializationParam[AbstractLeaf]],
        deserialization_context: DeserializationContext,
    ) -> Awaitable[Sequence[Leaf]]:
        """Returns the awaitable that reads the leaves, in the order of ``params``."""
        ...

    async def metadata(
        self,
        params: Sequence[DeserializationParam[None]],
        deserialization_context: DeserializationContext,
    ) -> Sequence[AbstractLeaf]:
        """The abstract form of each stored leaf."""
        ...


@runtime_checkable
class AbstractArray(Protocol):
    """Anything with a ``shape`` and a ``dtype`` (e.g. ``np.empty(...)``)."""

    shape: tuple[int, ...]
    dtype: Any


@runtime_checkable
class AbstractShardedArray(Protocol):
    """An abstract array that also names a sharding (e.g. ``jax.ShapeDtypeStruct``)."""

    shape: tuple[int, ...]
    dtype: Any
    sharding: Any
