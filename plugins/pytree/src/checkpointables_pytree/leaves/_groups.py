"""The leaves of a save that one leaf handler takes, handed to it as one group."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from checkpointables.serialization import SerializationParam

from checkpointables_pytree import tree, zarr3
from checkpointables_pytree.leaves._session import NamedSerializationParam

__all__ = ["ArrayRecords", "LeafGroup"]


class ArrayRecords(Protocol):
    """The ``_METADATA`` records of the arrays of a group scheduled at once
    (``_array_layouts.ArrayLayouts``), one per leaf of the group."""

    layouts: list[zarr3.ZarrLayout]
    records: list[dict[str, Any]]  # Shared by arrays of one layout: never changed.
    write_shapes: bool  # Whether entries record the write shape (the chunk shape).
    texts: dict[Any, list[str]]  # Their text, per value type (kept by ``saved_tree_metadata``).


class LeafGroup(Sequence[SerializationParam[Any]]):
    """The leaves of a save one leaf handler takes: its ``params``, made when first read.

    The standard handlers read ``values`` in the blocking phase and the params in
    the background one: an async save's caller waits for no per-leaf object.
    """

    def __init__(self, flat: tree.Flat, indices: Sequence[int], entries: dict[type, Any]) -> None:
        self.flat = flat
        self.indices = indices
        self.entries = entries  # Leaf type -> registry entry.
        # Set by a standard array handler that scheduled the group at once: the records
        # of its leaves for the _METADATA (else they are in the session's ``extras``).
        self.layouts: ArrayRecords | None = None

    @functools.cached_property
    def values(self) -> list[Any]:
        """The leaves' values."""
        values = self.flat.values
        return values if len(self.indices) == len(values) else [values[i] for i in self.indices]

    @functools.cached_property
    def params(self) -> list[NamedSerializationParam]:
        """The leaves as ``SerializationParam``\\ s (with their storage names)."""
        s = self.flat.structure
        names = s.storage_names
        return [
            NamedSerializationParam(keypath=s.keypaths[i], value=v, storage_name=names[i])
            for i, v in zip(self.indices, self.values, strict=True)
        ]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: Any) -> Any:
        return self.params[index]

    def __iter__(self) -> Iterator[SerializationParam[Any]]:
        return iter(self.params)
