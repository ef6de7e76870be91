"""Random inputs for the OCDBT conformance tests (``ocdbt/test_ocdbt_conformance.py``).

Strategies draw small descriptions (sizes, dtypes, shapes, seeds), not the
bytes themselves: hypothesis shrinks a failure to a short description that
reads well, and a megabyte array costs one ``rng.bytes`` call instead of a
megabyte of drawn data. ``build_*`` turn a description into the real thing.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np
import tensorstore as ts
from checkpointables_pytree import ocdbt, zarr3
from hypothesis import strategies as st

INLINE = ocdbt.MAX_INLINE_VALUE_BYTES
# Keys of several UTF-8 lengths sharing prefixes ('/' and '.' as in array keys).
KEY_CHARS = "ab/._%z0\u00e9\u4e2d"

# Value sizes: empty or tiny, either side of the inline limit, then data-file values.
VALUE_SIZES = st.one_of(
    st.integers(0, 40), st.integers(INLINE - 3, INLINE + 3), st.integers(INLINE + 4, 12_000)
)


def keys(chars: str = KEY_CHARS, min_size: int = 1, max_size: int = 80) -> Any:
    """Distinct keys over ``chars`` (the empty key included)."""
    return st.lists(st.text(chars, max_size=8), min_size=min_size, max_size=max_size, unique=True)


def value_bytes(seed: int, sizes: dict[str, int]) -> dict[str, bytes]:
    """Random values of the given sizes, the same for the same seed."""
    rng = np.random.default_rng(seed)
    return {key: rng.bytes(size) for key, size in sizes.items()}


# -- Ours -> TensorStore: a database written by ocdbt.DatabaseLayout ------------------------


class LayoutCase(NamedTuple):
    """A database for ``DatabaseLayout`` to write: its values, and how to lay them out."""

    sizes: dict[str, int]
    fixed: frozenset[str]  # Keys whose values are given to the layout itself.
    file_bytes: int
    first_file_bytes: int | None
    max_node_bytes: int
    seed: int


@st.composite
def layout_cases(draw: Any, max_keys: int = 120) -> LayoutCase:
    """Keys and value sizes, data files small enough that values straddle them, and nodes
    small enough for several leaves under an interior root (or TensorStore's default)."""
    names = draw(keys(max_size=max_keys))
    sizes = {name: draw(VALUE_SIZES) for name in names}
    fixed = frozenset(draw(st.sets(st.sampled_from(names))))
    file_bytes = draw(st.integers(1, 40_000))
    first = draw(st.none() | st.integers(1, file_bytes))
    max_node_bytes = draw(st.sampled_from([ocdbt.MAX_NODE_BYTES]) | st.integers(1, 4_000))
    seed = draw(st.integers(0, 2**32 - 1))
    return LayoutCase(sizes, fixed, file_bytes, first, max_node_bytes, seed)


# -- Ours -> TensorStore: a pytree saved by cp.save_pytree ----------------------------------

NUMPY_DTYPES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "complex64",
)
# Without jax_enable_x64, JAX holds 64-bit numbers in 32 bits: jax.Arrays of those dtypes
# would not be what the test made.
JAX_DTYPES = tuple(d for d in NUMPY_DTYPES if d not in {"int64", "uint64", "float64"})
MESH_SHAPE = {"x": 2, "y": 4}
# A chunk's value is its bytes and the shard's trailer: the inline limit in array bytes.
INLINE_ARRAY_BYTES = INLINE - zarr3.SHARD_TRAILER_BYTES
ARRAY_BYTES = {
    "tiny": st.integers(0, 64),
    "inline": st.integers(INLINE_ARRAY_BYTES - 24, INLINE_ARRAY_BYTES + 24),
    "medium": st.integers(INLINE_ARRAY_BYTES + 25, 40_000),
    # Three of these cross the first data file (2 MiB) of a save.
    "large": st.integers(300_000, 1_200_000),
}


class LeafSpec(NamedTuple):
    """One array leaf: a NumPy array, or a jax.Array with ``spec`` over the 2x4 mesh."""

    dtype: str
    shape: tuple[int, ...]
    jax: bool
    spec: tuple[str | None, ...]  # A PartitionSpec's entries (empty: replicated).
    inner_chunk_bytes: int | None  # Stored in inner chunks: through TensorStore's driver.
    seed: int


def dtype_of(name: str) -> np.dtype:
    """The NumPy dtype named ``name`` (``bfloat16`` from ``ml_dtypes``)."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


@st.composite
def leaf_specs(draw: Any, driver: bool = True, orbax: bool = False) -> LeafSpec:
    """An array of a random dtype, 0 to 3 dimensions (for Orbax to save if ``orbax``: no
    zero-size ones, lengths it chunks sensibly),
    sized in one of ``ARRAY_BYTES``' ranges, sharded over the mesh where its shape allows;
    if ``driver``, some stored in inner chunks (written by TensorStore's zarr3 driver)."""
    is_jax = draw(st.booleans())
    dtype = draw(st.sampled_from(JAX_DTYPES if is_jax else NUMPY_DTYPES))
    nbytes = draw(
        st.sampled_from(["tiny", "inline", "medium", "tiny", "large"]).flatmap(ARRAY_BYTES.get)
    )
    ndim = draw(st.integers(0, 3))
    leading = draw(
        st.lists(
            st.sampled_from([1, 2, 4, 8, 3] if orbax else [1, 2, 4, 8, 0, 3]),
            min_size=max(ndim - 1, 0),
            max_size=max(ndim - 1, 0),
        )
    )
    count = max(nbytes // dtype_of(dtype).itemsize, 1)
    last = count // max(int(np.prod(leading)), 1)
    if orbax and last > _ORBAX_CHUNK_STEP:
        # Orbax chunks a NumPy array by the divisors of its shape: a length of 599,999
        # became 599,999 one-element chunks, minutes to read under load.
        last -= last % _ORBAX_CHUNK_STEP
    shape = () if ndim == 0 else (*leading, max(last, 1) if orbax else last)
    spec: tuple[str | None, ...] = ()
    if is_jax and shape:
        options = [(None,) * i + (axis,) for i in range(len(shape)) for axis in MESH_SHAPE]
        options += [("x", "y"), ("y", "x")] if len(shape) > 1 else []
        spec = draw(st.sampled_from([(), *(s for s in options if _divides(s, shape))]))
    # About one leaf in ten, in 2 to 8 inner chunks (other leaves are encoded here).
    parts = draw(st.sampled_from([None] * 9 + [2, 8])) if driver else None
    inner = None if parts is None else max(count * dtype_of(dtype).itemsize // parts, 64)
    return LeafSpec(dtype, shape, is_jax, spec, inner, draw(st.integers(0, 2**32 - 1)))


_ORBAX_CHUNK_STEP = 1024


def _divides(spec: tuple[str | None, ...], shape: tuple[int, ...]) -> bool:
    """Whether the mesh axes of ``spec`` divide the dimensions they shard."""
    return all(a is None or n % MESH_SHAPE[a] == 0 for a, n in zip(spec, shape, strict=False))


def tree_specs(leaves: Any, max_size: int = 8) -> Any:
    """Nested dicts and lists of ``leaves``, keys over ``KEY_CHARS`` (our saves escape '.',
    '/' and '%'; Orbax does not)."""
    names = st.text(KEY_CHARS, min_size=1, max_size=5)
    node = st.one_of(
        leaves,
        st.dictionaries(names, leaves, min_size=1, max_size=4),
        st.lists(leaves, min_size=1, max_size=3),
    )
    return st.dictionaries(names, node, min_size=1, max_size=max_size)


_MESH: jax.sharding.Mesh | None = None


def build_leaf(spec: LeafSpec) -> Any:
    """The array ``spec`` describes: random bits (NaNs of any payload, subnormals...)."""
    global _MESH
    rng = np.random.default_rng(spec.seed)
    dtype = dtype_of(spec.dtype)
    size = int(np.prod(spec.shape))
    if dtype == np.bool_:
        array = rng.integers(0, 2, spec.shape).astype(np.bool_)
    else:
        array = np.frombuffer(rng.bytes(size * dtype.itemsize), dtype).reshape(spec.shape)
    if not spec.jax:
        return array.copy()
    if _MESH is None:
        devices = np.array(jax.devices()[:8]).reshape(tuple(MESH_SHAPE.values()))
        _MESH = jax.sharding.Mesh(devices, tuple(MESH_SHAPE))
    sharding = jax.sharding.NamedSharding(_MESH, jax.sharding.PartitionSpec(*spec.spec))
    return jax.device_put(array, sharding)


def build_tree(spec: Any) -> Any:
    """The pytree of arrays ``spec`` (from ``tree_specs``) describes."""
    return jax.tree_util.tree_map(build_leaf, spec, is_leaf=lambda x: isinstance(x, LeafSpec))


# -- TensorStore -> ours: databases TensorStore writes -------------------------------------


def ocdbt_configs() -> Any:
    """OCDBT configurations: compressed or not, inline limits, node sizes down to a few
    entries each, version trees of arity 2 (several versions make version nodes)."""
    return st.fixed_dictionaries(
        {
            "compression": st.sampled_from([None, {"id": "zstd"}, {"id": "zstd", "level": 9}]),
            "max_inline_value_bytes": st.sampled_from([INLINE, 0, 16, 100]),
            "max_decoded_node_bytes": st.sampled_from([ocdbt.MAX_NODE_BYTES, 200, 1_000, 5_000]),
            "version_tree_arity_log2": st.sampled_from([4, 1]),
        }
    )


class DatabaseCase(NamedTuple):
    """A database TensorStore writes: ``commits`` (values' sizes; ``None`` deletes) in
    turn, other writers' databases merged in after commit ``merge_after``."""

    config: dict[str, Any]
    manifest_kind: str
    commits: list[dict[str, int | None]]
    writers: list[tuple[dict[str, Any], dict[str, int]]]
    merge_after: int
    absent: list[str]
    seed: int


@st.composite
def database_cases(draw: Any, max_keys: int = 60) -> DatabaseCase:
    """A database of 1 to 4 commits, and 0 to 2 other writers' databases merged into it."""
    # Other writers' keys start with "w<i>/", absent keys are of 'z' and 'w': the
    # database's own keys have neither.
    chars = KEY_CHARS.replace("z", "")
    sizes_or_deletes = st.one_of(VALUE_SIZES, st.none())
    commits = draw(
        st.lists(
            st.dictionaries(
                st.text(chars, max_size=8), sizes_or_deletes, min_size=1, max_size=max_keys
            ),
            min_size=1,
            max_size=4,
        )
    )
    writers = draw(
        st.lists(
            st.tuples(
                ocdbt_configs(),
                st.dictionaries(st.text(chars, max_size=6), VALUE_SIZES, min_size=1, max_size=30),
            ),
            max_size=2,
        )
    )
    writers = [
        (c, {f"w{i}/{k}": n for k, n in values.items()}) for i, (c, values) in enumerate(writers)
    ]
    return DatabaseCase(
        config=draw(ocdbt_configs()),
        manifest_kind=draw(st.sampled_from(["single", "numbered"])),
        commits=commits,
        writers=writers,
        merge_after=draw(st.integers(0, len(commits) - 1)),
        absent=draw(st.lists(st.text("zw", min_size=1, max_size=3), max_size=3)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def ocdbt_store(
    directory: Any, config: dict[str, Any], context: ts.Context, kind: str = "single"
) -> ts.KvStore:
    """TensorStore's OCDBT kvstore of ``directory``, created with ``config`` if new (one
    ``context`` for the databases of a merge: TensorStore copies only within one)."""
    base = {"driver": "file", "path": f"{directory}/"}
    spec = {"driver": "ocdbt", "base": base, "config": {**config, "manifest_kind": kind}}
    return ts.KvStore.open(spec, context=context).result()


def commit(store: ts.KvStore, values: dict[str, bytes | None]) -> None:
    """Writes (``None``: deletes) ``values`` in one transaction: one new version."""
    with ts.Transaction() as transaction:
        into = store.with_transaction(transaction)
        for key, value in values.items():
            into.write(key, value).result()


def build_database(directory: Any, case: DatabaseCase) -> None:
    """Writes ``case`` with TensorStore: the commits, and the other writers' databases (in
    ``ocdbt.writer_<i>/`` inside ``directory``) merged in with ``experimental_copy_range_to``."""
    context = ts.Context()
    store = ocdbt_store(directory, case.config, context, case.manifest_kind)
    rng_seed = case.seed
    for n, sizes in enumerate(case.commits):
        present = {k: s for k, s in sizes.items() if s is not None}
        written = value_bytes(rng_seed + n, present)
        commit(store, {k: written.get(k) for k in sizes})
        if n == case.merge_after and case.writers:
            sources = []
            for i, (config, writer_sizes) in enumerate(case.writers):
                source = ocdbt_store(f"{directory}/ocdbt.writer_{i}", config, context)
                commit(source, dict(value_bytes(rng_seed + 100 + i, writer_sizes)))
                sources.append(source)
            with ts.Transaction(atomic=True) as transaction:
                into = store.with_transaction(transaction)
                for source in sources:
                    source.experimental_copy_range_to(into).result()


def as_dump(node: Any) -> list[dict[str, Any]]:
    """A decoded leaf node's entries as ``ts.ocdbt.dump`` shows them."""
    entries = []
    for i, key in enumerate(node.keys):
        if node.inline(i) is not None:
            entries.append({"key": key, "inline_value": node.inline(i)})
        else:
            file = node.files[node.file_ids[i]]
            where = f"value:{file}:{node.offsets[i]}:{node.lengths[i]}"
            entries.append({"key": key, "indirect_value": where})
    return entries
