"""Recognizing Grain iterators and datasets without importing Grain.

Importing Grain takes seconds. A Grain object cannot exist before the
``grain`` package is imported, so until the program imports it the answer to
"is this a Grain iterator?" is no, and the plugin costs nothing.
"""

from __future__ import annotations

import sys
from typing import Any, Literal

__all__ = [
    "DATASET_ITERATOR",
    "DATA_LOADER_ITERATOR",
    "iterator_kind",
    "is_iterable_source",
    "source_kind",
]

IteratorKind = Literal["DatasetIterator", "DataLoaderIterator"]
DATASET_ITERATOR: IteratorKind = "DatasetIterator"
DATA_LOADER_ITERATOR: IteratorKind = "DataLoaderIterator"


def _grain() -> Any | None:
    return sys.modules.get("grain")


def _first_attribute(module: Any, *names: str) -> Any | None:
    for name in names:
        value = getattr(module, name, None)
        if value is not None:
            return value
    return None


def _data_loader_iterator_type(grain: Any) -> type | None:
    # Public as grain.DataLoaderIterator in current releases; older ones only
    # exported it under grain.python as PyGrainDatasetIterator.
    found = _first_attribute(grain, "DataLoaderIterator")
    if found is None and "grain.python" in sys.modules:
        found = _first_attribute(
            sys.modules["grain.python"], "DataLoaderIterator", "PyGrainDatasetIterator"
        )
    return found


def iterator_kind(obj: Any) -> IteratorKind | None:
    """Which kind of Grain iterator ``obj`` is, or ``None`` if it is none."""
    grain = _grain()
    if grain is None or isinstance(obj, type):
        return None
    dataset_iterator = getattr(grain, "DatasetIterator", None)
    if dataset_iterator is not None and isinstance(obj, dataset_iterator):
        return DATASET_ITERATOR
    loader_iterator = _data_loader_iterator_type(grain)
    if loader_iterator is not None and isinstance(obj, loader_iterator):
        return DATA_LOADER_ITERATOR
    return None


def source_kind(obj: Any) -> str | None:
    """Which Grain dataset or data loader ``obj`` is (``"MapDataset"``, ``"IterDataset"``,
    ``"DataLoader"``: the public class it derives from), or ``None`` if it is none."""
    grain = _grain()
    if grain is None or isinstance(obj, type):
        return None
    for name in ("MapDataset", "IterDataset", "DataLoader"):
        source = getattr(grain, name, None)
        if isinstance(source, type) and isinstance(obj, source):
            return name
    return None


def is_iterable_source(obj: Any) -> bool:
    """Whether ``obj`` is a Grain dataset or data loader (``iter()`` makes an iterator)."""
    return source_kind(obj) is not None
