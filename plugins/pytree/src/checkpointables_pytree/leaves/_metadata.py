"""What ``cp.pytree_metadata`` returns for array and bytes leaves.

Each class is a valid abstract leaf: ``ArrayMetadata`` has ``shape``, ``dtype``
and ``sharding`` (an ``AbstractShardedArray``, restoring a ``jax.Array``),
``NumpyMetadata`` has ``shape`` and ``dtype`` (an ``AbstractArray``, restoring
NumPy), ``BytesMetadata`` is ``b""`` (an abstract ``bytes``) with the stored
length as ``nbytes``. So ``cp.load_pytree(path, cp.pytree_metadata(path).metadata)`` loads
the tree as saved.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import jax
import numpy as np

from checkpointables_pytree import tree

__all__ = ["StorageMetadata", "ArrayMetadata", "NumpyMetadata", "BytesMetadata"]


@attrs.frozen
class StorageMetadata:
    """How an array is chunked on disk.

    Attributes:
      chunk_shape: the shape of each stored shard (one per written shard).
      write_shape: the shard shape the saving process wrote (``jax.Array`` only).
    """

    chunk_shape: tuple[int, ...] | None
    write_shape: tuple[int, ...] | None = None


class _ArrayLike:
    __slots__ = ("dtype", "shape", "storage")

    def __init__(
        self, shape: tuple[int, ...], dtype: Any, storage: StorageMetadata | None = None
    ) -> None:
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.storage = storage

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the array in memory."""
        return self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)


class ArrayMetadata(_ArrayLike):
    """A stored ``jax.Array``: shape, dtype and the sharding it was saved with.

    ``sharding`` is that sharding rebuilt on this process's devices, or
    ``None`` when they differ (then loading places the array on the default
    device). ``sharding_metadata`` is the raw record.
    """

    __slots__ = ("_sharding", "sharding_metadata")

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: Any,
        sharding_metadata: Mapping[str, Any] | None = None,
        storage: StorageMetadata | None = None,
    ) -> None:
        super().__init__(shape, dtype, storage)
        self.sharding_metadata = dict(sharding_metadata) if sharding_metadata else None
        self._sharding: Any = ...

    @property
    def sharding(self) -> jax.sharding.Sharding | None:
        """The saved sharding on this process's devices, or ``None`` if they differ."""
        if self._sharding is ...:
            self._sharding = tree.rebuild(self.sharding_metadata)
        return self._sharding

    def to_shape_dtype_struct(self) -> jax.ShapeDtypeStruct:
        """A ``jax.ShapeDtypeStruct`` with the same shape, dtype and (if available) sharding."""
        return jax.ShapeDtypeStruct(self.shape, self.dtype, sharding=self.sharding)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ArrayMetadata)
            and self.shape == other.shape
            and self.dtype == other.dtype
            and self.sharding_metadata == other.sharding_metadata
        )

    def __hash__(self) -> int:
        return hash((self.shape, self.dtype))

    def _sharding_repr(self) -> str:
        """What ``sharding`` holds, and the saved sharding where it could not be rebuilt here
        (a load given this leaf then places the array on the default device)."""
        sharding = self.sharding
        if isinstance(sharding, jax.sharding.NamedSharding):
            return f"NamedSharding(mesh={dict(sharding.mesh.shape)}, spec={sharding.spec})"
        if sharding is not None:
            return type(sharding).__name__
        if not self.sharding_metadata:
            return "None"
        saved = tree.summary(self.sharding_metadata)
        return f"None (saved: {saved}, not on this machine's devices)"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype}, "
            f"sharding={self._sharding_repr()})"
        )


class NumpyMetadata(_ArrayLike):
    """A stored ``np.ndarray``: shape and dtype."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, NumpyMetadata)
            and self.shape == other.shape
            and self.dtype == other.dtype
        )

    def __hash__(self) -> int:
        return hash((self.shape, self.dtype))

    def __repr__(self) -> str:
        return f"NumpyMetadata(shape={self.shape}, dtype={self.dtype})"


class BytesMetadata(bytes):
    """A stored ``bytes`` leaf: ``b""`` (so an abstract ``bytes``), with its length as ``nbytes``.

    It equals ``b""``: ``cp.load_pytree(path, metadata)`` loads the bytes, and
    ``checkpointables inspect`` shows their size.
    """

    nbytes: int

    def __new__(cls, nbytes: int) -> BytesMetadata:
        """The metadata of a stored ``bytes`` of length ``nbytes``."""
        self = super().__new__(cls, b"")
        self.nbytes = int(nbytes)
        return self

    def __getnewargs__(self) -> tuple[int]:  # type: ignore[override]
        return (self.nbytes,)  # Copies and pickles keep the length.

    def __repr__(self) -> str:
        return f"BytesMetadata(nbytes={self.nbytes})"
