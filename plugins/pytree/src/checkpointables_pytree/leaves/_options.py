"""``ArrayOptions`` and ``ArrayStorageOptions``: how arrays of pytrees are stored and read.

The pytree plugin's own settings (zarr3 chunks, zstd, checksums, resizing on
load), added to ``cp.Context`` / ``cp.configure`` as ``array_options`` by
``plugin.py``'s ``register_options``; also ``cp.options.ArrayOptions`` and
``cp.options.ArrayStorageOptions``.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import checkpointables as cp
import numpy as np

from checkpointables_pytree import zarr3

__all__ = [
    "ArrayOptions",
    "ArrayStorageOptions",
    "FAST_PATH_ENVIRONMENT_VARIABLE",
    "check_shard_axes",
]

# Set to 0 (or false, off, no) to turn ``ArrayOptions.ocdbt_fast_path`` off by default.
FAST_PATH_ENVIRONMENT_VARIABLE = "CHECKPOINTABLES_OCDBT_FAST_PATH"


def _fast_path_default() -> bool:
    value = os.environ.get(FAST_PATH_ENVIRONMENT_VARIABLE, "1").strip().lower()
    return value not in ("0", "false", "off", "no")


def _storable_dtype(value: Any) -> bool:
    try:
        return zarr3.zarr_dtype_name(np.dtype(value)) is not None
    except (TypeError, ValueError):  # Not a dtype at all ("floaty", 5).
        return False


def _axes_tuple(value: Any) -> Any:
    # Anything that is not a collection of axes is left to the validator to name. Axes that
    # are NumPy or JAX scalars (jnp.int32(-1)) are kept as the ints they hold.
    if isinstance(value, Iterable) and not isinstance(value, str | bytes):
        try:
            return tuple(cp.options.python_scalar(a) for a in value)
        except TypeError:  # A 0-d array is Iterable by its type, not by its shape.
            return value
    return value


def _axes(value: tuple[Any, ...]) -> bool:
    return all(isinstance(a, numbers.Integral) and not isinstance(a, bool) for a in value)


@attrs.frozen
class ArrayStorageOptions:
    """How one array is laid out on disk.

    Every field is checked when the options are built
    (``cp.errors.InvalidArgumentError`` naming the field); ``shard_axes`` is
    checked against each array that a save splits into chunks.

    Attributes:
      dtype: store the array in this dtype (cast on save), a NumPy dtype or
        anything ``np.dtype`` takes that zarr3 can store (``np.float16``,
        ``jnp.bfloat16``, ``"int8"``); ``None`` keeps it.
      chunk_byte_size: split each written shard into chunks of at most this many
        bytes (an int >= 1), so that partial reads touch less data; ``None``
        writes one chunk per shard. Chunks divide the shard evenly: where only a
        split into chunks under a sixteenth of this size would (a prime length),
        the chunks stay larger than it rather than of a few bytes each.
      shard_axes: axes (ints; negative ones count from the end) to split first
        when ``chunk_byte_size`` chooses chunks. A save raises
        ``cp.errors.InvalidArgumentError`` naming the leaf when an array it
        splits does not have one of these axes: use negative axes, or give
        arrays of other ranks their own options through
        ``ArrayOptions.storage_options_creator``.
    """

    dtype: Any = attrs.field(
        default=None,
        validator=cp.options.option_validator(
            "None or a dtype zarr3 can store (e.g. np.float16, jnp.bfloat16, 'int8')",
            kind=object,
            test=_storable_dtype,
            optional=True,
        ),
    )
    chunk_byte_size: int | None = attrs.field(
        default=None,
        validator=cp.options.int_at_least(
            1, optional=True, allowed="an int >= 1 (bytes per chunk) or None (one chunk per shard)"
        ),
    )
    shard_axes: tuple[int, ...] = attrs.field(
        default=(),
        converter=_axes_tuple,
        validator=cp.options.option_validator(
            "a tuple of array axes (ints)", kind=tuple, test=_axes
        ),
    )


def check_shard_axes(
    storage: ArrayStorageOptions, write_shape: Sequence[int], itemsize: int, leaf: object
) -> None:
    """Raises if ``storage`` splits ``leaf``'s array along an axis it does not have.

    Only an array that ``chunk_byte_size`` splits reads ``shard_axes``: global
    options may name axes that smaller or lower-rank arrays of the tree lack.

    Raises:
      cp.errors.InvalidArgumentError: naming ``leaf`` (its key path), the axes,
        the array's rank and what to do.
    """
    ndim = len(write_shape)
    limit = storage.chunk_byte_size
    if not storage.shard_axes or not limit or math.prod(write_shape) * itemsize <= limit:
        return
    bad = [a for a in storage.shard_axes if not -ndim <= a < ndim]
    if bad:
        raise cp.errors.InvalidArgumentError(
            f"ArrayStorageOptions.shard_axes={storage.shard_axes} does not fit {leaf}, a "
            f"{ndim}-d array (axes {-ndim} to {ndim - 1}): {bad} are not axes of it. Pass axes "
            f"every chunked array has (negative ones count from the end: (-1,) is the last "
            f"axis), or give arrays of this rank their own ArrayStorageOptions through "
            f"ArrayOptions.storage_options_creator."
        )


@attrs.frozen
class ArrayOptions:
    """Options for arrays in pytrees.

    Attributes:
      storage_options: the layout used for every array, unless
        ``storage_options_creator`` returns something else for a key path.
      storage_options_creator: called as ``creator(key_path, value)`` for each
        array leaf; returns ``ArrayStorageOptions`` or ``None`` to keep the
        global ones.
      use_compression: compress chunks with zstd (smaller, slower).
      enable_padding_and_truncation: on load, a requested shape that differs
        from the stored one pads with zeros or truncates instead of raising.
      verify_checksums: check every chunk on load, against the checksum
        recorded at save time or the chunk's own CRC-32C. Turning it off
        saves CPU time on trusted storage; damage then goes unnoticed.
      ocdbt_fast_path: the plugin writes and reads the OCDBT database of plain
        arrays itself, in TensorStore's format (about half the CPU of a
        small-tree save, twice the speed of a small-tree load). ``False``
        makes TensorStore write and read every key, as Orbax does; either
        way the checkpoint is the same format, readable by both. The default
        is ``True`` unless the environment variable
        ``CHECKPOINTABLES_OCDBT_FAST_PATH`` is ``0``, ``false``, ``off`` or ``no``.
    """

    storage_options: ArrayStorageOptions = attrs.field(
        default=ArrayStorageOptions(),
        validator=cp.options.option_validator(
            "a cp.options.ArrayStorageOptions", kind=ArrayStorageOptions
        ),
    )
    storage_options_creator: Callable[[tuple[Any, ...], Any], ArrayStorageOptions | None] | None = (
        attrs.field(
            default=None,
            validator=cp.options.option_validator(
                "None or a function (key_path, value) -> ArrayStorageOptions | None",
                kind=object,
                test=callable,
                optional=True,
            ),
        )
    )
    use_compression: bool = attrs.field(default=False, validator=cp.options.boolean())
    enable_padding_and_truncation: bool = attrs.field(default=False, validator=cp.options.boolean())
    verify_checksums: bool = attrs.field(default=True, validator=cp.options.boolean())
    ocdbt_fast_path: bool = attrs.field(factory=_fast_path_default, validator=cp.options.boolean())
