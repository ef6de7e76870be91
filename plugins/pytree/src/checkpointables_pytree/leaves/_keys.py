"""Typed PRNG keys (``jax.random.key``) as pytree leaves, in Orbax's format.

A key array is stored as its key data (``jax.random.key_data``: unsigned
integers with trailing dimensions, ``(..., 2)`` uint32 for ``threefry2x32``,
``(..., 4)`` for ``rbg`` and ``unsafe_rbg``), as a ``jax.Array`` leaf whose
shards are those of the key data. Orbax marks such an array as a key by
naming its implementation in ``array_metadatas/process_<i>``
(``"ext_metadata": {"random_key_impl": "threefry2x32"}``); we write the same
mark, and also record it in the leaf's own ``_METADATA`` fields, so loading
needs no extra read. Each format reads the other's keys as keys.

Loading a key needs an abstract leaf with a key dtype (``AbstractPRNGKey``:
``jax.ShapeDtypeStruct(shape, jax.random.key_dtype("rbg"), sharding=...)``,
a key array, or the ``PRNGKeyMetadata`` of ``cp.pytree_metadata``), or none:
the recorded implementation then decides.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, cast

import attrs
import checkpointables as cp
import jax
import numpy as np
from checkpointables.serialization import (
    DeserializationContext,
    DeserializationParam,
    SerializationParam,
)
from etils import epath

from checkpointables_pytree import io
from checkpointables_pytree import tree as tree_room
from checkpointables_pytree.io import StoredArray
from checkpointables_pytree.leaves._array_handlers import ArrayLeafHandler
from checkpointables_pytree.leaves._common import (
    JAX_ARRAY,
    StoredLayout,
    finish_load,
    load_session,
    storage_options,
    unsupported,
)
from checkpointables_pytree.leaves._metadata import ArrayMetadata, StorageMetadata
from checkpointables_pytree.leaves._session import ARRAY_METADATAS_DIR, LoadSession, SaveSession

__all__ = [
    "PRNG_KEY",
    "RANDOM_KEY_IMPL",
    "AbstractPRNGKey",
    "PRNGKeyLeafHandler",
    "PRNGKeyMetadata",
    "is_key_dtype",
    "key_array_type",
    "mark_orbax_keys",
    "key_impl_problems",
]

# Orbax's ext_metadata field naming a key array's implementation (and ours in _METADATA).
RANDOM_KEY_IMPL = "random_key_impl"
# Our own value type of key leaves: their Orbax value_type is jax.Array's.
PRNG_KEY = "prng_key"
# The implementations JAX ships.
_JAX_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")


def key_array_type() -> type:
    """The class of typed key arrays (``type(jax.random.key(0))``), found without making a key."""
    try:
        from jax._src.random.prng import PRNGKeyArray
    except ImportError:
        try:
            # Where older JAX releases keep it.
            from jax._src.prng import PRNGKeyArray as OlderPRNGKeyArray
        except ImportError:  # Moved again: make a key (this initializes JAX's backend).
            return type(jax.random.key(0))
        return OlderPRNGKeyArray  # type: ignore[no-any-return]
    return PRNGKeyArray


def is_key_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is a PRNG key dtype (``key<fry>``, ``key<rbg>``...)."""
    if dtype is None or isinstance(dtype, np.dtype):  # The common case, decided at once.
        return False
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


class _KeyDtypeCheck(type):
    def __instancecheck__(cls, instance: Any) -> bool:
        # Asked of every abstract leaf of every load: NumPy dtypes are ruled out first.
        dtype = getattr(instance, "dtype", None)
        return not isinstance(dtype, np.dtype) and is_key_dtype(dtype)


class AbstractPRNGKey(metaclass=_KeyDtypeCheck):
    """Any abstract leaf whose ``dtype`` is a PRNG key dtype (checked by ``isinstance``).

    ``jax.ShapeDtypeStruct(shape, jax.random.key_dtype("threefry2x32"),
    sharding=...)``, a key array, and ``PRNGKeyMetadata`` all are. A sharding
    places the keys; without one they load on the default device.
    """

    # Class attributes, so the registry sees this type as narrower than AbstractShardedArray.
    shape: tuple[int, ...] = ()
    dtype: Any = None
    sharding: Any = None


@functools.lru_cache(maxsize=32)  # Only valid implementation names are cached.
def _key_data_layout(impl: str) -> tuple[Any, tuple[int, ...], np.dtype]:
    """``(key dtype, trailing shape, data dtype)`` of implementation ``impl``."""
    dtype = jax.random.key_dtype(impl)
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
    return dtype, tuple(int(s) for s in data.shape), np.dtype(data.dtype)


def _layout_or_raise(impl: Any, where: str) -> tuple[Any, tuple[int, ...], np.dtype]:
    if not isinstance(impl, str):
        raise cp.errors.MetadataError(
            f"{where}: the recorded PRNG key implementation {impl!r} is not a name; the "
            "checkpoint's metadata is damaged."
        )
    try:
        return _key_data_layout(impl)
    except (TypeError, ValueError, KeyError) as e:
        raise cp.errors.MissingHandlerError(
            f"{where} holds PRNG keys of implementation {impl!r}, which JAX does not know here "
            f"({e}). Register that implementation with JAX first, or skip the leaf with "
            "cp.PLACEHOLDER."
        ) from None


@functools.lru_cache(maxsize=32)
def _impl_of_dtype(dtype: Any) -> str | None:
    """The name of the implementation JAX ships whose key dtype is ``dtype``, if any."""
    for impl in _JAX_IMPLS:
        if _key_data_layout(impl)[0] == dtype:
            return impl
    return None


def _pad_spec(spec: jax.sharding.PartitionSpec, ndim: int) -> tuple[Any, ...]:
    return (*spec, *([None] * (ndim - len(spec))))


def _physical_sharding(sharding: Any, ndim: int, trailing: int) -> Any:
    """The key data's sharding for keys of ``ndim`` dims sharded by ``sharding``, or ``None``."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = jax.sharding.PartitionSpec(*_pad_spec(sharding.spec, ndim), *([None] * trailing))
        return jax.sharding.NamedSharding(sharding.mesh, spec)
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    return None  # Read onto the default device, then placed by jax.device_put.


def _logical_sharding(sharding: Any, ndim: int) -> Any:
    """The keys' sharding, from their key data's (the inverse of ``_physical_sharding``)."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = _pad_spec(sharding.spec, ndim)[:ndim]
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    return sharding


class PRNGKeyMetadata(ArrayMetadata):
    """A stored typed key array: shape, key dtype, implementation and saved sharding.

    What ``cp.pytree_metadata`` returns for a key leaf, and a valid abstract
    leaf: it loads the keys with the sharding they were saved with, when this
    process has those devices (else on the default device).
    """

    __slots__ = ("impl",)

    def __init__(
        self,
        shape: tuple[int, ...],
        impl: str,
        sharding_metadata: Mapping[str, Any] | None = None,
        storage: StorageMetadata | None = None,
    ) -> None:
        # The recorded sharding is the key data's: ``sharding`` turns it into the keys'.
        self.shape = tuple(int(s) for s in shape)
        self.dtype = jax.random.key_dtype(impl)
        self.storage = storage
        self.sharding_metadata = dict(sharding_metadata) if sharding_metadata else None
        self._sharding: Any = ...
        self.impl = impl

    @property
    def sharding(self) -> jax.sharding.Sharding | None:
        """The saved sharding on this process's devices, or ``None`` if they differ."""
        if self._sharding is ...:
            physical = tree_room.rebuild(self.sharding_metadata)
            self._sharding = _logical_sharding(physical, len(self.shape))
        return self._sharding  # type: ignore[no-any-return]


@attrs.frozen
class _KeyRead:
    """How one key leaf is read: its implementation and where the keys go."""

    impl: str
    place_on: Any  # A sharding jax.device_put applies after reading, or None.


class PRNGKeyLeafHandler(ArrayLeafHandler):
    """Saves typed PRNG key arrays as their key data, in Orbax's format; loads them as keys.

    Every implementation JAX ships (``threefry2x32``, ``rbg``, ``unsafe_rbg``)
    works, sharded or not; keys load onto any mesh, like arrays.
    """

    def _schedule_writes(
        self, session: SaveSession, params: Sequence[SerializationParam[Any]]
    ) -> None:
        impls = [self._impl_name(p) for p in params]  # Every leaf checked before any is planned.
        data = [dataclasses.replace(p, value=jax.random.key_data(p.value)) for p in params]
        lacking = io.arrays_the_primary_lacks(
            {p.name: p.value for p in data},
            session.directory,
            session.context,
            asker=type(self).__qualname__,
        )
        for param, physical, impl in zip(params, data, impls, strict=True):
            # The saved dtype is the key data's, whatever the save's storage options say.
            storage = attrs.evolve(storage_options(session, param.keypath, param.value), dtype=None)
            self._schedule_array(
                session,
                physical,
                primary_lacks=physical.name in lacking,
                storage=storage,
                ext_metadata={RANDOM_KEY_IMPL: impl},
            )

    @staticmethod
    def _impl_name(param: SerializationParam[Any]) -> str:
        if param.value.is_deleted():
            raise unsupported(
                param.keypath, param.value, "the keys were deleted (or donated) before the save"
            )
        impl = jax.random.key_impl(param.value)
        if not isinstance(impl, str) or _impl_of_dtype(param.value.dtype) != impl:
            raise unsupported(
                param.keypath,
                param.value,
                f"its PRNG implementation ({param.value.dtype}) is not one JAX ships "
                f"({', '.join(_JAX_IMPLS)}), so no reader could rebuild the keys; save "
                "jax.random.key_data(keys) instead",
            )
        return impl

    async def deserialize(
        self,
        params: Sequence[DeserializationParam[Any]],
        deserialization_context: DeserializationContext,
    ) -> Awaitable[Sequence[jax.Array]]:
        """Schedules the reads of the key data; returns the awaitable that yields the keys."""
        session, private = load_session(self, deserialization_context)
        reads, keys, entries = [], [], []
        for param in params:
            entry, _ = session.info(param.keypath, getattr(param, "names", None))
            key, physical = self._plan_key(entry, param.value, session.stored_array(entry))
            reads.append(self._schedule_read(session, dataclasses.replace(param, value=physical)))
            keys.append(key)
            entries.append(entry)

        async def wrap() -> list[jax.Array]:
            data = await finish_load(session, private, reads)
            result = []
            for key, array, entry in zip(keys, data, entries, strict=True):
                _check_key_data(entry, key.impl, array.shape, array.dtype)
                wrapped = jax.random.wrap_key_data(array, impl=key.impl)
                if key.place_on is not None:
                    wrapped = jax.device_put(wrapped, key.place_on)
                result.append(wrapped)
            return result

        return wrap()

    @staticmethod
    def _plan_key(
        entry: tree_room.Entry, abstract: Any, stored: StoredArray | None
    ) -> tuple[_KeyRead, Any]:
        """How a key leaf is read, and the abstract leaf of its key data (``None``: as stored)."""
        recorded = entry.extra.get(RANDOM_KEY_IMPL)
        wanted = None if abstract is None or isinstance(abstract, type) else abstract.dtype
        if recorded is not None:
            dtype, trailing, data_dtype = _layout_or_raise(recorded, entry.keystr)
            if wanted is not None and wanted != dtype:
                raise cp.errors.TreeMismatchError(
                    f"{entry.keystr} holds {recorded} keys ({dtype}); the abstract tree asks for "
                    f"{wanted}. Use an abstract leaf of dtype jax.random.key_dtype({recorded!r}), "
                    "or cp.PLACEHOLDER to skip it."
                )
            impl = recorded
            if wanted is None and stored is not None:  # Trusted from _METADATA: checked.
                _check_key_data(entry, impl, stored.shape, stored.dtype)
        else:
            impl = _impl_of_key_data(entry, abstract, stored)
            _, trailing, data_dtype = _key_data_layout(impl)
        if wanted is None:
            return _KeyRead(impl, None), None
        shape = tuple(int(s) for s in abstract.shape)
        sharding = getattr(abstract, "sharding", None)
        if not isinstance(sharding, jax.sharding.Sharding):
            sharding = None
        physical_sharding = _physical_sharding(sharding, len(shape), len(trailing))
        physical = jax.ShapeDtypeStruct((*shape, *trailing), data_dtype, sharding=physical_sharding)
        return _KeyRead(impl, sharding if physical_sharding is None else None), physical

    def _describe(
        self, session: LoadSession, entry: tree_room.Entry, layout: StoredLayout
    ) -> PRNGKeyMetadata:
        """Shape, implementation and recorded sharding of a stored key array."""
        impl = entry.extra.get(RANDOM_KEY_IMPL)
        _, trailing, _ = _layout_or_raise(impl, entry.keystr)
        return PRNGKeyMetadata(
            layout.shape[: len(layout.shape) - len(trailing)],
            cast(str, impl),  # _layout_or_raise raised unless it is a str.
            sharding_metadata=session.sharding_record(session.tree.storage_name(entry.names)),
            storage=StorageMetadata(layout.chunk_shape, entry.write_shape),
        )


def _check_key_data(entry: tree_room.Entry, impl: str, shape: Any, dtype: Any) -> None:
    """Raises unless key data of ``shape`` and ``dtype`` is what implementation ``impl``'s
    keys are made of (``_METADATA`` names the implementation: an edited name must not reach
    ``jax.random.wrap_key_data`` as a raw ``TypeError``, nor wrap data of another shape)."""
    _, trailing, data_dtype = _key_data_layout(impl)
    shape = tuple(int(s) for s in shape)
    if shape[len(shape) - len(trailing) :] != trailing or np.dtype(dtype) != data_dtype:
        raise cp.errors.MetadataError(
            f"{entry.keystr}: _METADATA records {impl} PRNG keys, whose key data is "
            f"(..., {', '.join(map(str, trailing))}) {data_dtype}, but the array stored is "
            f"{shape} {np.dtype(dtype)}: the metadata is damaged. Restore the checkpoint from a "
            "copy, or load the leaf with an abstract leaf of the key dtype you expect."
        )


def _impl_of_key_data(entry: tree_room.Entry, abstract: Any, stored: StoredArray | None) -> str:
    """The implementation to wrap a plain stored array with: the key data of ``abstract``'s keys.

    Raises:
      cp.errors.TreeMismatchError: the leaf was not saved as keys, nor as fitting key data.
    """
    dtype = getattr(abstract, "dtype", None)
    impl = _impl_of_dtype(dtype) if is_key_dtype(dtype) else None
    if impl is not None:
        _, trailing, data_dtype = _key_data_layout(impl)
        expected = (*(int(s) for s in abstract.shape), *trailing)
        if stored is None or (stored.dtype == data_dtype and stored.shape == expected):
            return impl  # (Unrecorded layouts are checked when read.)
    raise cp.errors.TreeMismatchError(
        f"{entry.keystr} was not saved as PRNG keys"
        + (f", nor as the key data of {abstract.shape} {dtype} keys" if impl else "")
        + "; load it with an array abstract leaf, or cp.PLACEHOLDER to skip it."
    )


def mark_orbax_keys(tree: tree_room.TreeMetadata, directory: epath.Path) -> None:
    """Marks the key arrays of a tree Orbax wrote as we mark ours (in their ``_METADATA`` fields).

    Orbax names a key array's implementation only in ``array_metadatas/``;
    trees we wrote carry it in ``_METADATA`` already, and are left alone.
    """
    if tree.escaped_names:
        return
    arrays = {tree.storage_name(e.names): e for e in tree.entries if e.value_type == JAX_ARRAY}
    folder = directory / ARRAY_METADATAS_DIR
    if not arrays or not cp.storage.is_dir(folder):
        return
    for name, impl in _recorded_impls(folder).items():
        entry = arrays.get(name)
        if entry is not None and isinstance(impl, str):
            entry.extra = {
                **entry.extra,
                RANDOM_KEY_IMPL: impl,
                tree_room.OWN_VALUE_TYPE: PRNG_KEY,
            }
            tree.own_value_types = True


def _recorded_impls(folder: epath.Path) -> dict[str, Any]:
    """``{param name: implementation}`` from the first process's array metadata file."""
    names = [e.name for e in cp.storage.list_dir(folder)]
    if not names:
        return {}
    first = folder / min(names, key=lambda n: (n != "process_0", n))
    try:
        raw = cp.storage.read_bytes(first, max_bytes=cp.metadata_checksums.MAX_FILE_BYTES)
        document = cp.safe_json.loads_object(raw, source=first)  # Bounded depth, no NaN.
        items = [item["array_metadata"] for item in document["array_metadatas"]]
        return {
            item["param_name"]: (item.get("ext_metadata") or {}).get(RANDOM_KEY_IMPL)
            for item in items
            if (item.get("ext_metadata") or {}).get(RANDOM_KEY_IMPL) is not None
        }
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise cp.errors.MetadataError(
            f"{first} is malformed ({e!r}); it names which arrays are PRNG keys. Restore it "
            "from a copy of the checkpoint."
        ) from None


def key_impl_problems(tree: tree_room.TreeMetadata, directory: epath.Path) -> list[str]:
    """Arrays that ``array_metadatas/`` (Orbax's record, which this library writes too) marks
    as PRNG keys of one implementation while ``_METADATA`` records another, or none: the
    second record ``checkpointables verify`` checks a key's implementation against."""
    if not tree.escaped_names:
        return []  # Orbax's tree: its keys are marked from array_metadatas/ itself.
    folder = directory / ARRAY_METADATAS_DIR
    if not cp.storage.is_dir(folder):
        return []
    marked: dict[str, Any] = {}
    for name in sorted(e.name for e in cp.storage.list_dir(folder)):
        marked.update(_impls_in(folder / name))
    problems = []
    for entry in tree.entries:
        impl = marked.get(tree.storage_name(entry.names))
        if impl is not None and entry.extra.get(RANDOM_KEY_IMPL) != impl:
            recorded = entry.extra.get(RANDOM_KEY_IMPL)
            problems.append(
                f"{entry.keystr}: {folder} records {impl} PRNG keys, {directory}/_METADATA "
                + (f"{recorded} keys" if recorded else "no keys")
                + ": one of them is damaged; a load would trust _METADATA."
            )
    return problems


def _impls_in(file: epath.Path) -> dict[str, Any]:
    """``{param name: implementation}`` of one process's array metadata file."""
    try:
        raw = cp.storage.read_bytes(file, max_bytes=cp.metadata_checksums.MAX_FILE_BYTES)
        document = cp.safe_json.loads_object(raw, source=file)
        items = [item["array_metadata"] for item in document["array_metadatas"]]
        return {
            item["param_name"]: (item.get("ext_metadata") or {}).get(RANDOM_KEY_IMPL)
            for item in items
            if (item.get("ext_metadata") or {}).get(RANDOM_KEY_IMPL) is not None
        }
    except (KeyError, TypeError, AttributeError) as e:
        raise cp.errors.MetadataError(
            f"{file} is malformed ({e!r}); it names which arrays are PRNG keys. Restore it "
            "from a copy of the checkpoint."
        ) from None
