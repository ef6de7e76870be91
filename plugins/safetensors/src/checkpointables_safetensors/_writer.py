"""Writing safetensors files tensor by tensor, sharded like the Hugging Face Hub's.

The ``safetensors`` package writes a file only from tensors that are all in
memory at once (its maintainers keep it so: safetensors#291, #531). An export
larger than memory streams instead: this module writes the header the format
specifies (8-byte little-endian length, then JSON with each tensor's dtype
code, shape and byte offsets, padded with spaces to a multiple of 8), then
each tensor's bytes as they arrive. The dtype codes come from the package
(``TensorSpec``), and every file is opened with the package's ``safe_open``,
which checks the header against the file, before it is moved into place.

Files are written under temporary names and renamed into place only once
all of them are complete and fsynced; the index comes last. A failed export
leaves no partial file under a final name.

Layout of a large export (``model.safetensors`` asked, 3 shards)::

    model-00001-of-00003.safetensors ... model-00003-of-00003.safetensors
    model.safetensors.index.json   {"metadata": {"total_size": N}, "weight_map": {name: file}}
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import sys
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import checkpointables as cp
import jax
import numpy as np

from checkpointables_safetensors._files import (
    INDEX_SUFFIX,
    SUFFIX,
    code_of,
    refuse_inside_checkpoint,
    safe_open,
)
from checkpointables_safetensors._reads import Limits, pieces

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "TensorEntry",
    "Output",
    "parse_size",
    "plan_shards",
    "write_safetensors",
]

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # "5GB", the Hub's usual shard size.
DEFAULT_FILE_NAME = "model" + SUFFIX
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


@attrs.frozen
class TensorEntry:
    """One tensor to write: its name in the file, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@attrs.frozen
class Output:
    """Where an export goes: ``directory/stem.safetensors`` or its shards and index."""

    directory: str
    stem: str

    @classmethod
    def at(cls, path: os.PathLike[str] | str) -> Output:
        """``x/model.safetensors`` writes that file (or its shards); a directory gets ``model``.

        Raises:
          cp.errors.UnsupportedPathError: ``path`` is a URL (``s3://``, ``gs://``...).
          cp.errors.InvalidArgumentError: ``path`` is an existing file not named ``*.safetensors``.
        """
        if not cp.storage.is_local(path):
            # Files are streamed larger than memory, fsynced and renamed into place; an object
            # store takes a file in one write. (Without this, abspath makes a folder "s3:".)
            raise cp.errors.UnsupportedPathError(
                f"{os.fspath(path)}: safetensors files are written to local disk. Export to a "
                f"local path, then upload the files (e.g. `aws s3 cp --recursive` or "
                f"`gcloud storage cp`)."
            )
        text = os.path.abspath(os.fspath(path))
        if text.endswith(SUFFIX) and not os.path.isdir(text):
            return cls(os.path.dirname(text), os.path.basename(text).removesuffix(SUFFIX))
        if os.path.lexists(text) and not os.path.isdir(text):
            # Not replaced even with overwrite: it is no export's file (they are named
            # *.safetensors, and shards and an index go with them), so it is not ours to remove.
            raise cp.errors.InvalidArgumentError(
                f"{path} is an existing file whose name does not end in {SUFFIX}: the output "
                f"must be a *{SUFFIX} path or a directory (for {DEFAULT_FILE_NAME}). Name it "
                f"{os.path.basename(text)}{SUFFIX}, or remove the file first."
            )
        _refuse_a_file_name(path, text)
        return cls(text, DEFAULT_FILE_NAME.removesuffix(SUFFIX))

    def file_names(self, count: int) -> list[str]:
        """The names of ``count`` files, as the Hub names shards."""
        if count == 1:
            return [self.stem + SUFFIX]
        return [f"{self.stem}-{i:05d}-of-{count:05d}{SUFFIX}" for i in range(1, count + 1)]

    @property
    def index_name(self) -> str:
        """The index file's name."""
        return self.stem + INDEX_SUFFIX

    def existing_files(self) -> list[str]:
        """The paths of an earlier export's files here (one file, or shards and an index,
        of any count), which a new export replaces whole."""
        try:
            names = os.listdir(self.directory)
        except (FileNotFoundError, NotADirectoryError):
            return []
        shard = re.compile(rf"{re.escape(self.stem)}-\d{{5}}-of-\d{{5}}{re.escape(SUFFIX)}")
        ours = {self.stem + SUFFIX, self.index_name}
        found = [n for n in names if n in ours or shard.fullmatch(n)]
        return [os.path.join(self.directory, n) for n in sorted(found)]


# A name's extension: letters, then letters or digits ("out.txt", "model.safetenors",
# "weights.pt"); not "gemma-2.0" or "run.5", which name directories as often as not.
_EXTENSION = re.compile(r"\.[A-Za-z][A-Za-z0-9]{0,15}")


def _refuse_a_file_name(path: os.PathLike[str] | str, text: str) -> None:
    """Refuses a new output named like a file of another kind (``out.txt``, a typo such as
    ``out.safetenors``), which would otherwise become a directory holding
    ``model.safetensors``. A path ending in a separator, or a directory that exists, is a
    directory by choice."""
    given = os.fspath(path)
    if os.path.isdir(text) or given.endswith((os.sep, "/")):
        return
    extension = os.path.splitext(text)[1]
    if not _EXTENSION.fullmatch(extension):
        return
    raise cp.errors.InvalidArgumentError(
        f"{given} ends in {extension!r}, not {SUFFIX}: the output is a *{SUFFIX} file, or a "
        f"directory to write {DEFAULT_FILE_NAME} in. Name the file "
        f"{os.path.splitext(given)[0]}{SUFFIX}; for a directory of that name, end the path "
        f"with a slash ({given}/) or create the directory first."
    )


def parse_size(text: str | int) -> int:
    """Bytes of a size such as ``"5GB"`` (10**9 each), ``"500MiB"`` (2**20 each) or ``"1024"``.

    Raises:
      cp.errors.InvalidArgumentError: the text is not a size, or the size is not positive
        (a ``ValueError``).
    """
    if isinstance(text, int):
        value = text
    else:
        # A sign is taken so that "-5GB" is refused as negative, not as "not a size".
        match = re.fullmatch(r"\s*([-+]?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise cp.errors.InvalidArgumentError(
                f"{text!r} is not a size; write e.g. 5GB, 500MB, 2GiB or 1000000."
            )
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise cp.errors.InvalidArgumentError(f"a size must be positive, got {text!r}.")
    return value


def plan_shards(entries: Sequence[TensorEntry], max_shard_size: int) -> list[list[TensorEntry]]:
    """The files to write ``entries`` (in tree order) as: each a list in the order of its data.

    Files take the entries in order, each filled until the next entry would
    take it over ``max_shard_size`` bytes of data; a tensor larger than the
    limit gets a file of its own, as on the Hub. In a file, larger items come
    first (so each is aligned), in tree order otherwise. Give the result to
    ``write_safetensors`` as it is: the cut is made once, on the tree order,
    so reordering a file's data cannot move a tensor to another file.
    """
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    # sorted() is stable: tree order among items of one size.
    return [sorted(shard, key=lambda e: -e.dtype.itemsize) for shard in shards]


def _header(entries: Sequence[TensorEntry], metadata: Mapping[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for entry in entries:
        header[entry.name] = {
            "dtype": code_of(entry.dtype),
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # Keeps the data 8-byte aligned, as the package does.
    return len(text).to_bytes(8, "little") + text


def _check(shape: tuple[int, ...], dtype: np.dtype, entry: TensorEntry) -> None:
    if shape != entry.shape or dtype != entry.dtype:
        # The tree (or the checkpoint's data) changed since its metadata was read.
        raise cp.errors.TreeMismatchError(
            f"Tensor {entry.name!r}: expected shape {entry.shape} and dtype {entry.dtype}, got "
            f"{shape} and {dtype}."
        )


def _little_endian(array: np.ndarray) -> np.ndarray:
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big"):
        array = array.astype(array.dtype.newbyteorder("<"))
    return np.ascontiguousarray(array)


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.partial(jax.jit, static_argnums=2)
def _slice(array: jax.Array, starts: tuple[jax.Array, ...], sizes: tuple[int, ...]) -> jax.Array:
    """A block of ``array`` on its devices (compiled per block shape, not per offset)."""
    return jax.lax.dynamic_slice(array, starts, sizes)


def _host_pieces(array: jax.Array, entry: TensorEntry, limit: int) -> Iterator[np.ndarray]:
    """``array`` on the host in C-order pieces of at most ``limit`` bytes: on CPU devices
    views of their buffers, else each copied from the devices when its turn comes."""
    _check(tuple(array.shape), np.dtype(array.dtype), entry)
    devices = array.sharding.device_set
    first: Any = next(iter(devices))  # Typed Any: JAX's stubs leave ``Device`` unresolved.
    # One CPU device: its buffer viewed, no copy (several would be gathered: a copy).
    whole = np.asarray(array) if len(devices) == 1 and first.platform == "cpu" else None
    for region in pieces(entry.shape, entry.dtype.itemsize, limit):
        if whole is not None:
            yield whole[region]
            continue
        sizes = tuple(r.stop - r.start for r in region)
        yield np.asarray(_slice(array, tuple(np.int32(r.start) for r in region), sizes))


def _write_tensor(f: Any, array: Any, entry: TensorEntry, piece: int) -> None:
    """Writes ``entry``'s data: a host array at once, a ``jax.Array`` (a budgeted export)
    in pieces of at most ``piece`` bytes."""
    if isinstance(array, jax.Array):
        for values in _host_pieces(array, entry, piece):
            f.write(_little_endian(values).reshape(-1).view(np.uint8).data)
        return
    _check(array.shape, array.dtype, entry)
    f.write(_little_endian(array).reshape(-1).view(np.uint8).data)


def _write_file(
    path: str,
    entries: Sequence[TensorEntry],
    arrays: Iterator[Any],
    metadata: Mapping[str, str],
) -> None:
    piece = Limits.in_context().piece
    with open(path, "wb") as f:
        f.write(_header(entries, metadata))
        for entry in entries:
            _write_tensor(f, next(arrays), entry, piece)
            cp.progress.advance(entry.nbytes)
        f.flush()
        os.fsync(f.fileno())
    with safe_open(path) as check:  # The package checks the header against the file.
        if len(check.keys()) != len(entries):
            raise cp.errors.MetadataError(f"{path}: the written header lost tensors.")


def _remove(files: Iterable[str]) -> None:
    for file in files:
        with contextlib.suppress(FileNotFoundError):
            os.remove(file)


def _stale_files(output: Output, finals: Sequence[str], overwrite: bool) -> list[str]:
    """An earlier export's files there that this one does not replace (its other layout,
    more shards), which would be read in place of it: removed after the new files are
    written (its index first). Without ``overwrite``, any earlier file is refused."""
    existing = output.existing_files()
    if existing and not overwrite:
        raise cp.errors.CheckpointExistsError(
            f"{existing[0]} exists; pass overwrite=True (--overwrite) to replace it."
        )
    return [f for f in existing if f not in finals]


def write_safetensors(
    output: Output,
    shards: Sequence[Sequence[TensorEntry]],
    arrays: Iterable[Any],
    *,
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
) -> list[str]:
    """Writes the files of a ``plan_shards`` plan, Hub-style with an index if several.

    Returns the paths written. ``arrays`` yields each entry's array in the
    order of ``shards``, files first then entries, so a caller can stream them:
    ``np.ndarray``s, written at once, or ``jax.Array``s, copied to the host in
    pieces within the context's budget (``cp.options.MemoryOptions``).

    Raises:
      cp.errors.CheckpointExistsError: an earlier export's file is there (``model.safetensors``,
        or its shards and index) and ``overwrite`` is false; with it, they are all replaced.
      cp.errors.TreeMismatchError: an array does not match its entry.
      ValueError: a dtype safetensors cannot hold (callers refuse those first: ``_as_entry``).
      cp.errors.InvalidArgumentError: the output is in a checkpoint (``refuse_inside_checkpoint``).
    """
    refuse_inside_checkpoint(output.directory, "safetensors files")
    entries = [e for shard in shards for e in shard]
    names = output.file_names(len(shards))
    finals = [os.path.join(output.directory, n) for n in names]
    if len(shards) > 1:
        finals.append(os.path.join(output.directory, output.index_name))
    stale = _stale_files(output, finals, overwrite)
    for entry in entries:
        code_of(entry.dtype)  # Refuse unsupported dtypes before writing anything.
    os.makedirs(output.directory, exist_ok=True)
    tag = f".tmp-{uuid.uuid4().hex[:8]}"
    temporaries = [f + tag for f in finals]
    stream = iter(arrays)
    try:
        for shard, temporary in zip(shards, temporaries[: len(shards)], strict=True):
            _write_file(temporary, shard, stream, metadata or {})
        if len(shards) > 1:
            weight_map = {e.name: n for shard, n in zip(shards, names, strict=True) for e in shard}
            index = {
                "metadata": {"total_size": sum(e.nbytes for e in entries)},
                "weight_map": dict(sorted(weight_map.items())),
            }
            with open(temporaries[-1], "w") as f:
                json.dump(index, f, indent=2)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
        _remove(f for f in stale if f.endswith(INDEX_SUFFIX))
        for temporary, final in zip(temporaries, finals, strict=True):
            os.replace(temporary, final)
        _remove(stale)
        _fsync_directory(output.directory)
    finally:
        for temporary in temporaries:
            if os.path.exists(temporary):
                os.remove(temporary)
    return finals
