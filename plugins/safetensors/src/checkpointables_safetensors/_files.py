"""The files behind a safetensors path, and what their headers say.

A path is one of: a ``*.safetensors`` file; a Hugging Face index
(``model.safetensors.index.json``, whose ``weight_map`` names each tensor's
file); or a directory holding either (an index wins; without one, every
``*.safetensors`` file in it, which must not share tensor names). Headers
are read and checked by the ``safetensors`` package (``safe_open``): a
truncated file, a header claiming more bytes than the file holds, or a
malformed header is refused there, before any array is allocated.
"""

from __future__ import annotations

import collections
import functools
import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import checkpointables as cp
import jax.numpy as jnp
import numpy as np
from etils import epath

__all__ = [
    "SUFFIX",
    "INDEX_SUFFIX",
    "StoredTensor",
    "TensorSet",
    "code_of",
    "recognizes",
    "open_tensor_set",
    "safe_open",
    "refuse_inside_checkpoint",
]

SUFFIX = ".safetensors"
# The most bytes NumPy can index (and so JAX, whose host arrays are NumPy's).
_MAX_BYTES = int(np.iinfo(np.intp).max)
INDEX_SUFFIX = ".safetensors.index.json"
# NumPy/ml_dtypes names of the dtypes safetensors can hold (the package maps them to its codes).
_DTYPE_NAMES = (
    "bool",
    "uint8",
    "int8",
    "uint16",
    "int16",
    "uint32",
    "int32",
    "uint64",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)


@attrs.frozen
class StoredTensor:
    """One tensor as its file's header describes it."""

    name: str
    file: str
    shape: tuple[int, ...]
    dtype: np.dtype
    start: int = -1  # Where its bytes begin in ``file`` (-1: not known).

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@attrs.frozen
class TensorSet:
    """Every tensor behind a path, in file order then data order.

    Attributes:
      source: the path given.
      files: the ``.safetensors`` files read.
      tensors: tensor name to ``StoredTensor``.
      metadata: the files' ``__metadata__`` (string to string), merged.
    """

    source: epath.Path
    files: tuple[str, ...]
    tensors: Mapping[str, StoredTensor]
    metadata: Mapping[str, str]

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors' data."""
        return sum(t.nbytes for t in self.tensors.values())


@functools.cache
def _dtypes_by_code() -> dict[str, np.dtype]:
    return {code_of(np.dtype(jnp.dtype(name))): np.dtype(jnp.dtype(name)) for name in _DTYPE_NAMES}


def code_of(dtype: np.dtype) -> str:
    """The safetensors dtype code (``"BF16"``) of a NumPy dtype, as the package maps it.

    Raises:
      ValueError: safetensors cannot store the dtype (the message lists those it can).
    """
    from safetensors import SafetensorError, TensorSpec

    try:
        return TensorSpec(dtype=dtype.name, shape=[1], data_ptr=0, data_len=dtype.itemsize).dtype
    except (SafetensorError, ValueError) as e:
        raise ValueError(f"safetensors cannot store {dtype.name}: {e}") from None


def safe_open(file: str) -> Any:
    """``safetensors.safe_open(file)`` for NumPy, its errors as ``cp.errors.MetadataError``
    (``cp.errors.IntegrityError`` if ``file`` is not a regular file)."""
    from safetensors import SafetensorError
    from safetensors import safe_open as package_safe_open

    # The package opens the file itself: refuse a pipe (its open would block) or a directory
    # first. (A file swapped for a pipe after this check is not caught.)
    os.close(cp.storage.open_regular_file(file))
    try:
        return package_safe_open(file, framework="numpy")
    except SafetensorError as e:
        raise cp.errors.MetadataError(
            f"{file} is not a valid safetensors file: {e}. It may be truncated (an "
            f"interrupted download or copy) or damaged; fetch it again."
        ) from e


def _local(path: epath.Path) -> str | None:
    """``path`` as a string when it is on the local filesystem (not ``gs://``...), else None."""
    text = os.fspath(path)
    return None if "://" in text else text


def recognizes(path: epath.Path) -> bool:
    """Whether ``path`` names safetensors data (cheap: names and a directory listing)."""
    name = path.name
    local = _local(path)
    if local is None:  # Remote: by name only; loading then says to download it.
        return name.endswith((SUFFIX, INDEX_SUFFIX))
    if os.path.isfile(local):
        return name.endswith((SUFFIX, INDEX_SUFFIX))
    if not os.path.isdir(local):
        return False
    with os.scandir(local) as entries:
        return any(e.name.endswith((SUFFIX, INDEX_SUFFIX)) and e.is_file() for e in entries)


def _self_and_parents(path: os.PathLike[str] | str) -> list[str]:
    """``path`` and the directories above it, nearest first: local ones resolved (a link
    into a checkpoint counts too); on an object store the prefixes up to the bucket."""
    text = os.fspath(path)
    if cp.storage.is_local(text):
        found = [os.path.realpath(text)]
        while os.path.dirname(found[-1]) != found[-1]:
            found.append(os.path.dirname(found[-1]))
        return found
    head, _, rest = text.partition("://")
    parts = [p for p in rest.split("/") if p]  # The bucket, then the keys' components.
    return [f"{head}://{'/'.join(parts[:n])}" for n in range(len(parts), 0, -1)]


def refuse_inside_checkpoint(path: os.PathLike[str] | str, what: str) -> None:
    """Refuses to write ``what`` at ``path`` (local or on an object store) when ``path`` is a
    checkpoint or lies in one: a finished checkpoint is never changed (its loads and
    ``verify`` would meet files its save did not write).

    Raises:
      cp.errors.InvalidArgumentError: naming the checkpoint.
    """
    candidates = _self_and_parents(path)
    for current in candidates:
        if cp.is_checkpoint(current):
            where = "is" if current == candidates[0] else "is inside"
            raise cp.errors.InvalidArgumentError(
                f"{path} {where} the finished checkpoint {current}: writing {what} there would "
                f"change that checkpoint. Choose a path outside it."
            )


def _files_of(path: epath.Path) -> tuple[list[str], dict[str, str] | None]:
    """The files to read and, from an index, the weight map."""
    local = _local(path)
    if local is None:
        raise cp.errors.CheckpointError(
            f"{path}: safetensors files are read from local disk. Download them first "
            f"(e.g. huggingface_hub.snapshot_download) and load the local copy."
        )
    if not os.path.exists(local):
        raise cp.errors.CheckpointNotFoundError(f"No safetensors file or directory at {path}.")
    if os.path.isdir(local):
        names = sorted(os.listdir(local))
        indexes = [n for n in names if n.endswith(INDEX_SUFFIX)]
        if len(indexes) > 1:
            # Said for every caller (load_pytree, inspect, import): name the index, not the
            # directory.
            raise cp.errors.MetadataError(
                f"{path} holds several indexes {indexes}, and which to read is not clear. "
                f"Give the path of one instead of the directory, e.g. {path / indexes[0]}."
            )
        if indexes:
            return _files_of(path / indexes[0])
        files = [os.path.join(local, n) for n in names if n.endswith(SUFFIX)]
        if not files:
            raise cp.errors.MetadataError(f"{path} holds no *{SUFFIX} file.")
        return files, None
    if local.endswith(INDEX_SUFFIX):
        weight_map = _read_index(local)
        directory = os.path.dirname(local)
        files = sorted({os.path.join(directory, f) for f in weight_map.values()})
        return files, {k: os.path.join(directory, f) for k, f in weight_map.items()}
    return [local], None


def _unique_keys(what: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A ``json`` ``object_pairs_hook`` refusing a key repeated in an object: ``json`` keeps
    the last, where another reader may take the first (other bytes, another file)."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        found = dict(pairs)
        if len(found) != len(pairs):
            counts = collections.Counter(k for k, _ in pairs)
            repeated = sorted(k for k, n in counts.items() if n > 1)
            raise cp.errors.MetadataError(
                f"{what} lists {repeated} more than once; the file is damaged or was written "
                f"by a broken tool."
            )
        return found

    return unique


# An index names files, not data: a model of a million tensors has one of some
# tens of MB. Bounded like a checkpoint's metadata files, so a damaged or hostile
# one (a sparse file of many GiB) is refused before it is read.
MAX_INDEX_BYTES = cp.metadata_checksums.MAX_FILE_BYTES


def _read_index(index: str) -> dict[str, str]:
    """The index's ``weight_map``.

    Raises:
      cp.errors.MetadataError: the index is not JSON of that form (or nested too deeply
        to parse), repeats a key, or holds more than ``MAX_INDEX_BYTES``.
    """
    try:
        raw = cp.storage.read_bytes(index, max_bytes=MAX_INDEX_BYTES)
    except cp.errors.MetadataError:
        raise cp.errors.MetadataError(
            f"{index} holds more than {MAX_INDEX_BYTES:,} bytes, more than a safetensors "
            f"index (tensor names and file names) ever holds: it is damaged or not an index. "
            f"Load the *{SUFFIX} files' directory without it, or restore it from a copy."
        ) from None
    except OSError as e:
        raise _not_an_index(index, e) from e
    try:
        document = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys(index))
        weight_map = document["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and os.path.basename(v) == v
            for k, v in weight_map.items()
        ):
            raise ValueError("weight_map must map tensor names to file names in its directory")
    except cp.errors.MetadataError:
        raise
    except RecursionError:  # The parser's, unwound cleanly: JSON nested beyond its depth.
        raise _not_an_index(index, "it holds JSON nested too deeply to parse") from None
    except (ValueError, KeyError, TypeError) as e:
        raise _not_an_index(index, e) from e
    return weight_map


def _not_an_index(index: str, problem: Exception | str) -> cp.errors.MetadataError:
    if isinstance(problem, Exception):
        problem = f"{type(problem).__name__}: {problem}"
    return cp.errors.MetadataError(
        f"{index} is not a valid safetensors index ({problem}); it must be "
        f'JSON like {{"weight_map": {{"tensor name": "model-00001-of-00002.safetensors"}}}}.'
    )


def _data_starts(file: str) -> dict[str, int]:
    """Where each tensor's bytes begin in ``file`` (the package checked its header already).

    Raises:
      cp.errors.MetadataError: a key repeats in an object of the header (the package
        keeps the last of two entries of one tensor, which the format forbids: another
        reader would see the first, with other bytes or another dtype).
    """

    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length), object_pairs_hook=_unique_keys(f"{file}: its header"))
    return {
        name: 8 + length + entry["data_offsets"][0]
        for name, entry in header.items()
        if name != "__metadata__"
    }


def _read_header(file: str) -> tuple[list[StoredTensor], dict[str, str]]:
    codes = _dtypes_by_code()
    tensors = []
    with safe_open(file) as f:
        starts = _data_starts(file)
        metadata = dict(f.metadata() or {})
        for name in f.offset_keys():
            view = f.get_slice(name)
            code = view.get_dtype()
            if code not in codes:
                raise cp.errors.MetadataError(
                    f"{file}: tensor {name!r} has dtype {code}, which has no NumPy/JAX "
                    f"equivalent here (supported: {sorted(codes)})."
                )
            shape = tuple(view.get_shape())
            _check_shape(file, name, shape, codes[code])
            tensors.append(StoredTensor(name, file, shape, codes[code], starts[name]))
    return tensors, metadata


def _check_shape(file: str, name: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """Refuses a shape NumPy and JAX cannot make: its nonzero dimensions multiply to more
    bytes than they can index. (The package checks a tensor's bytes against its data
    offsets, so only a tensor with a zero dimension, holding no data, gets this far.)"""
    extent = math.prod(n for n in shape if n) * dtype.itemsize
    if extent > _MAX_BYTES:
        raise cp.errors.MetadataError(
            f"{file}: tensor {name!r} has shape {list(shape)}, whose nonzero dimensions make "
            f"{extent} bytes of {dtype.name}, above the 2**63 - 1 that NumPy and JAX can index "
            f"(even for an empty tensor); the file is damaged or was written by a broken tool."
        )


def open_tensor_set(path: epath.PathLike) -> TensorSet:
    """Reads the headers of every file behind ``path``; reads no tensor data.

    Raises:
      FileNotFoundError: ``path`` or a file its index names does not exist.
      cp.errors.MetadataError: a file or the index is malformed or truncated, or
        two files hold the same tensor; the message names the file.
    """
    path = epath.Path(path)
    files, weight_map = _files_of(path)
    tensors: dict[str, StoredTensor] = {}
    metadata: dict[str, str] = {}
    for file in files:
        if not os.path.exists(file):  # Not a regular file: refused by safe_open, saying so.
            raise cp.errors.CheckpointNotFoundError(
                f"{path} names {file}, which does not exist: download it too, or fetch the "
                f"set again."
            )
        found, file_metadata = _read_header(file)
        metadata.update(file_metadata)
        for tensor in found:
            if tensor.name in tensors:
                raise cp.errors.MetadataError(
                    f"The tensor {tensor.name!r} is in both {tensors[tensor.name].file} and "
                    f"{file}; load one of the files, or write an index that chooses."
                )
            tensors[tensor.name] = tensor
    if weight_map is not None:
        _check_weight_map(path, weight_map, tensors)
    return TensorSet(path, tuple(files), tensors, metadata)


def _check_weight_map(
    path: epath.Path, weight_map: dict[str, str], tensors: dict[str, StoredTensor]
) -> None:
    wrong = [n for n, f in weight_map.items() if n not in tensors or tensors[n].file != f]
    if wrong:
        name = wrong[0]
        where = tensors[name].file if name in tensors else "no file"
        raise cp.errors.MetadataError(
            f"{path} maps {len(wrong)} tensor(s) to files that do not hold them, e.g. {name!r} "
            f"to {weight_map[name]} (found in {where}). The index and the files do not belong "
            f"together; fetch them again."
        )
