"""``ArrayOptions`` and ``ArrayStorageOptions``: how arrays of pytrees are stored and read.

The pytree plugin's own settings (zarr3 chunks, zstd, checksums, resizing on
load), added to ``cp.Context`` / ``cp.configure`` as ``array_options`` by
``plugin.py``'s ``register_options``; also ``cp.options.ArrayOptions`` and
``cp.options.ArrayStorageOptions``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["ArrayOptions", "ArrayStorageOptions", "FAST_PATH_ENVIRONMENT_VARIABLE"]

# Set to 0 (or false, off, no) to turn ``ArrayOptions.ocdbt_fast_path`` off by default.
FAST_PATH_ENVIRONMENT_VARIABLE = "CHECKPOINTABLES_OCDBT_FAST_PATH"


def _fast_path_default() -> bool:
    value = os.environ.get(FAST_PATH_ENVIRONMENT_VARIABLE, "1").strip().lower()
    return value not in ("0", "false", "off", "no")


@attrs.frozen
class ArrayStorageOptions:
    """How one array is laid out on disk.

    Attributes:
      dtype: store the array in this dtype (cast on save); ``None`` keeps it.
      chunk_byte_size: split each written shard into chunks of at most this many
        bytes, so that partial reads touch less data; ``None`` writes one chunk
        per shard.
      shard_axes: axes to split first when choosing chunks.
    """

    dtype: Any = None
    chunk_byte_size: int | None = None
    shard_axes: tuple[int, ...] = attrs.field(default=(), converter=tuple)


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

    storage_options: ArrayStorageOptions = ArrayStorageOptions()
    storage_options_creator: Callable[[tuple[Any, ...], Any], ArrayStorageOptions | None] | None = (
        None
    )
    use_compression: bool = False
    enable_padding_and_truncation: bool = False
    verify_checksums: bool = True
    ocdbt_fast_path: bool = attrs.field(factory=_fast_path_default)
