"""Issue 28: the OCDBT codec held to TensorStore, both ways, over random inputs.

Ours -> TensorStore: databases ``ocdbt.DatabaseLayout`` writes (random keys, values on
both sides of the inline limit and of data-file boundaries, nodes small enough for many
leaves under an interior root) and pytrees ``cp.save_pytree`` writes (random dtypes,
shapes, shardings, inner chunks) are read bit-exact by TensorStore's ``ocdbt`` and
``zarr3`` drivers, listed key by key by ``ts.ocdbt.dump``, and TensorStore commits on top.

TensorStore -> ours: databases TensorStore writes (compressed or not, several versions,
small nodes, other writers' databases merged in) are read by ``ocdbt.DatabaseIndex``
exactly as TensorStore's kvstore reads them; every node is decoded by ``ocdbt.decode``
as dump decodes it, or left to dump because it is compressed; and pytrees Orbax saves
load bit-exact.

The default run takes about a minute on two cores. The ``slow`` variants run when
``CHECKPOINTABLES_CONFORMANCE_EXAMPLES`` is set, with that many examples per property
(a fifth as many of Orbax's saves; 200 take about two minutes more)::

    CHECKPOINTABLES_CONFORMANCE_EXAMPLES=200 uv run pytest \
        tests/plugins/pytree/ocdbt/test_ocdbt_conformance.py
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import shutil
from typing import Any

import checkpointables as cp
import checkpointables_pytree
import jax
import numpy as np
import pytest
import tensorstore as ts
from checkpointables_pytree import ocdbt
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from .. import ocdbt_cases as cases

_SLOW_EXAMPLES = int(os.environ.get("CHECKPOINTABLES_CONFORMANCE_EXAMPLES", "200"))
# The variants with more examples run when asked for (CI keeps the default size).
_ON_REQUEST = pytest.mark.skipif(
    "CHECKPOINTABLES_CONFORMANCE_EXAMPLES" not in os.environ,
    reason="set CHECKPOINTABLES_CONFORMANCE_EXAMPLES=N to run N examples per property",
)


def _examples(count: int) -> settings:
    # No example database in the repository: a failure prints its reproduction blob.
    return settings(
        max_examples=count,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def _in_scratch(tmp_path_factory: Any, check: Any, *args: Any, child: str = "") -> None:
    """``check(directory, *args)`` in a fresh directory (or its ``child``), removed after:
    hundreds of examples of megabytes each would fill the disk (the blob reproduces one)."""
    scratch = tmp_path_factory.mktemp(check.__name__.lstrip("_"))
    try:
        check(scratch / child if child else scratch, *args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# -- Reading a database as TensorStore reads it --------------------------------------------


def _file_store(directory: Any) -> ts.KvStore:
    return ts.KvStore.open({"driver": "file", "path": f"{directory}/"}).result()


def _read_all(directory: Any) -> dict[bytes, bytes]:
    """Every key and value of the database, as TensorStore's ocdbt kvstore reads them."""
    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{directory}/"}).result()
    keys = store.list().result()
    reads = [store.read(k) for k in keys]
    return {k: r.result().value for k, r in zip(keys, reads, strict=True)}


def _range(directory: Any, location: str) -> bytes:
    """The bytes at a dump's ``<kind>:<base>:<relative>:<offset>:<length>``."""
    base, relative, offset, length = ocdbt.split_location(location)
    with open(os.path.join(directory, base + relative), "rb") as f:
        f.seek(offset)
        return f.read(length)


def _nodes(directory: Any) -> tuple[dict[str, Any], list[tuple[str, bytes, Any]]]:
    """``ts.ocdbt.dump``'s manifest, and every node of the latest b-tree as ``(location,
    key prefix, dump)``, leaves in key order."""
    base = _file_store(directory)
    manifest = ts.ocdbt.dump(base).result()
    latest = max(manifest["versions"], key=lambda v: v["generation_number"])
    if "root" not in latest or "location" not in latest["root"]:
        return manifest, []  # An empty database.
    nodes, pending = [], [(latest["root"]["location"], b"")]
    while pending:
        location, prefix = pending.pop()
        node = ts.ocdbt.dump(base, location).result()
        nodes.append((location, prefix, node))
        if node["height"] > 0:
            children = [
                (e["location"], prefix + e.get("subtree_common_prefix", b""))
                for e in node["entries"]
            ]
            pending.extend(reversed(children))
    return manifest, nodes


def _leaf_entries(directory: Any) -> list[tuple[bytes, dict[str, Any]]]:
    """Every leaf entry of the latest b-tree, with its whole key, in the tree's order."""
    _, nodes = _nodes(directory)
    return [
        (prefix + entry["key"], entry)
        for _, prefix, node in nodes
        if node["height"] == 0
        for entry in node["entries"]
    ]


def _assert_dump_lists(directory: Any, values: dict[bytes, bytes], inline_limit: int) -> None:
    """dump lists every key once, in order; values of at most ``inline_limit`` bytes are
    inline, the others at the data file range that holds them."""
    entries = _leaf_entries(directory)
    assert [key for key, _ in entries] == sorted(values)
    for key, entry in entries:
        if "inline_value" in entry:
            assert entry["inline_value"] == values[key] and len(values[key]) <= inline_limit, key
        else:
            assert len(values[key]) > inline_limit, key
            assert _range(directory, entry["indirect_value"]) == values[key], key


def _assert_index_reads(directory: Any, values: dict[bytes, bytes], absent=()) -> None:
    """``ocdbt.DatabaseIndex`` finds every value TensorStore reads: inline, or the range of
    a data file inside ``directory`` that holds exactly its bytes."""
    found = asyncio.run(ocdbt.DatabaseIndex(directory).find([*values, *absent]))
    assert set(found) == set(values)
    root = os.path.realpath(directory)
    for key, value in found.items():
        if isinstance(value, ocdbt.ValueLocation):
            assert os.path.realpath(value.file).startswith(root + os.sep), value
            with open(value.file, "rb") as f:
                f.seek(value.offset)
                value = f.read(value.length)
        assert value == values[key], key


def _assert_nodes_decode_as_dump(directory: Any) -> int:
    """Every node of the latest b-tree: ``ocdbt.decode`` gives what dump gives, or ``None``
    exactly when the node says it is compressed. Returns how many nodes were compressed."""
    compressed = 0
    for location, _, dumped in _nodes(directory)[1]:
        data = _range(directory, location)
        decoded = ocdbt.decode(data, ocdbt.split_location(location)[0])
        # After the magic and the length: the format version, then the compression method.
        if data[13] != 0:
            assert decoded is None, location
            compressed += 1
        elif dumped["height"] == 0:
            assert cases.as_dump(decoded) == dumped["entries"], location
        else:
            fields = ("key", "subtree_common_prefix", "location")
            assert decoded == [{k: e.get(k, b"") for k in fields} for e in dumped["entries"]]
    return compressed


def _commit_on_top(
    directory: Any, before: dict[bytes, bytes], change: bool = True
) -> dict[bytes, bytes]:
    """TensorStore commits a version on top: new keys first and last, and if ``change``
    an overwrite and a delete. Returns what the database then holds."""
    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{directory}/"}).result()
    changes: dict[bytes, bytes | None] = {b"\x00first": b"1", b"\xff/last": b"L" * 2000}
    keys = sorted(before)
    if keys and change:
        changes[keys[0]] = b"overwritten"
        changes[keys[-1]] = None
    cases.commit(store, changes)
    after = dict(before)
    for key, value in changes.items():
        if value is None:
            after.pop(key, None)
        else:
            after[key] = value
    return after


# -- Ours -> TensorStore: databases written by DatabaseLayout -------------------------------


def _write_layout(directory: Any, case: cases.LayoutCase) -> dict[bytes, bytes]:
    """Writes ``case`` with ``ocdbt.DatabaseLayout``: each variable value given in one to
    three parts (bytes and NumPy arrays). Returns the values, by key."""
    values = cases.value_bytes(case.seed, case.sizes)
    layout = ocdbt.DatabaseLayout(
        list(values),
        [len(v) for v in values.values()],
        [v if k in case.fixed else None for k, v in values.items()],
        file_bytes=case.file_bytes,
        first_file_bytes=case.first_file_bytes,
        max_node_bytes=case.max_node_bytes,
    )
    rng = np.random.default_rng(case.seed)
    filled = []
    for key, value in values.items():
        if key not in case.fixed:
            cuts = sorted(rng.integers(0, len(value) + 1, rng.integers(0, 3)).tolist())
            parts = [value[a:b] for a, b in zip([0, *cuts], [*cuts, len(value)], strict=True)]
            filled.append([np.frombuffer(p, np.uint8) if n % 2 else p for n, p in enumerate(parts)])
    names = layout.file_names()
    files = [layout.data_file(n, names, filled) for n in range(layout.data_files)]
    btree, manifest = layout.btree_file(names, filled)
    for file in [*files, btree, ocdbt.DataFile(ocdbt.MANIFEST_FILE, [manifest])]:
        ocdbt.write_local_file(str(directory), file, flush=False)
    return {k.encode(): v for k, v in values.items()}


def _check_layout(directory: Any, case: cases.LayoutCase) -> None:
    values = _write_layout(directory, case)
    assert _read_all(directory) == values
    _assert_dump_lists(directory, values, ocdbt.MAX_INLINE_VALUE_BYTES)
    manifest, nodes = _nodes(directory)
    (version,) = manifest["versions"]  # One version, generation 1, of every key.
    assert version["generation_number"] == 1
    assert version["root"]["statistics"]["num_keys"] == len(values)
    leaves = sum(node["height"] == 0 for _, _, node in nodes)
    assert version["root_height"] == (leaves > 1) and len(nodes) == leaves + (leaves > 1)
    _assert_index_reads(directory, values, [b"absent", b"a/absent"])
    after = _commit_on_top(directory, values)
    assert _read_all(directory) == after
    _assert_index_reads(directory, after)


_MANY_LEAVES = cases.LayoutCase(
    {f"layer_{i}/c/{i % 3}": (i * 37) % 2_000 for i in range(300)},
    frozenset(f"layer_{i}/c/{i % 3}" for i in range(0, 300, 4)),
    file_bytes=20_000,
    first_file_bytes=3_000,
    max_node_bytes=2_000,
    seed=7,
)


# Leaves of inline values only have an empty data file table (ocdbt.decode once failed).
_INLINE_LEAVES = cases.LayoutCase({"": 0, "0": 0}, frozenset(), 1, None, 1, 0)


@_examples(60)
@given(case=cases.layout_cases())
@example(case=_MANY_LEAVES)
@example(case=_INLINE_LEAVES)
def test_tensorstore_reads_what_the_layout_writes(tmp_path_factory, case) -> None:
    _in_scratch(tmp_path_factory, _check_layout, case)


@pytest.mark.slow
@_ON_REQUEST
@_examples(_SLOW_EXAMPLES)
@given(case=cases.layout_cases(max_keys=400))
def test_tensorstore_reads_what_the_layout_writes_more(tmp_path_factory, case) -> None:
    _in_scratch(tmp_path_factory, _check_layout, case)


# -- Ours -> TensorStore: pytrees saved by cp.save_pytree -----------------------------------


def _arrays(tree: Any) -> dict[str, np.ndarray]:
    """The arrays of ``tree`` (as the host sees them), by storage name."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {cp.serialization.param_name_from_keypath(p): np.asarray(v) for p, v in flat}


def _assert_same_array(read: np.ndarray, expected: np.ndarray, name: str) -> None:
    assert (read.dtype, read.shape) == (expected.dtype, expected.shape), name
    assert read.tobytes() == expected.tobytes(), name


def _assert_zarr3_reads(database: Any, arrays: dict[str, np.ndarray]) -> None:
    """TensorStore's zarr3 driver over its ocdbt driver reads every array bit-exact."""
    context = ts.Context()
    opened = {
        name: ts.open(
            {
                "driver": "zarr3",
                "kvstore": {"driver": "ocdbt", "base": f"file://{database}/", "path": f"{name}/"},
            },
            context=context,
            open=True,
        )
        for name in arrays
    }
    for name, future in opened.items():
        _assert_same_array(future.result().read().result(), arrays[name], name)


def _save(directory: Any, tree_spec: Any) -> tuple[dict[str, np.ndarray], bool]:
    """Saves the tree ``tree_spec`` describes; returns its arrays (by storage name) and
    whether TensorStore's driver wrote some (those stored in inner chunks)."""
    flat = jax.tree_util.tree_flatten_with_path(tree_spec, is_leaf=_is_spec)[0]
    names = {cp.serialization.param_name_from_keypath(p): s for p, s in flat}
    inner = {n: s.inner_chunk_bytes for n, s in names.items() if s.inner_chunk_bytes}

    def storage_for(keypath: Any, value: Any) -> Any:
        chunk = inner.get(cp.serialization.param_name_from_keypath(keypath))
        return None if chunk is None else cp.options.ArrayStorageOptions(chunk_byte_size=chunk)

    tree = cases.build_tree(tree_spec)
    with cp.Context(array_options=cp.options.ArrayOptions(storage_options_creator=storage_for)):
        cp.save_pytree(directory, tree)
    return _arrays(tree), bool(inner)


def _is_spec(x: Any) -> bool:
    return isinstance(x, cases.LeafSpec)


def _check_saved(directory: Any, tree_spec: Any) -> None:
    arrays, driver = _save(directory, tree_spec)
    database = directory / "pytree"
    recorded = json.loads((database / "_METADATA").read_text())["tree_metadata"]
    names = {cp.serialization.param_name_from_keypath(ast.literal_eval(k)) for k in recorded}
    values = _read_all(database)
    zarr_json = {k.decode().removesuffix("/zarr.json") for k in values if k.endswith(b"/zarr.json")}
    assert names == zarr_json == set(arrays)
    _assert_zarr3_reads(database, arrays)
    manifest, _ = _nodes(database)
    if driver:  # TensorStore's writers' databases merged into ours.
        assert [key for key, _ in _leaf_entries(database)] == sorted(values)
    else:  # Ours alone: one version, uncompressed nodes.
        assert [v["generation_number"] for v in manifest["versions"]] == [1]
        assert manifest["config"]["compression"] is None
        _assert_dump_lists(database, values, ocdbt.MAX_INLINE_VALUE_BYTES)
    _assert_index_reads(database, values)
    after = _commit_on_top(database, values, change=False)
    assert _read_all(database) == after
    _assert_zarr3_reads(database, arrays)
    checkpointables_pytree.record_checksums_again(directory)  # Committed on top on purpose.
    for name, array in _arrays(cp.load_pytree(directory)).items():
        _assert_same_array(array, arrays[name], name)


def _leaf(dtype: str, count: int, seed: int) -> cases.LeafSpec:
    return cases.LeafSpec(dtype, (count,), False, (), None, seed)


# Three arrays of a megabyte: the second data file starts after the first 2 MiB.
_ACROSS_DATA_FILES = {f"big{i}": _leaf("float32", 1 << 18, i) for i in range(3)}


@_examples(15)
@given(tree_spec=cases.tree_specs(cases.leaf_specs()))
@example(tree_spec=_ACROSS_DATA_FILES)
@pytest.mark.fast_path  # It checks what our own writer wrote (one version, uncompressed).
def test_tensorstore_reads_the_pytrees_we_save(tmp_path_factory, tree_spec) -> None:
    _in_scratch(tmp_path_factory, _check_saved, tree_spec, child="c")


@pytest.mark.slow
@_ON_REQUEST
@_examples(_SLOW_EXAMPLES)
@given(tree_spec=cases.tree_specs(cases.leaf_specs(), max_size=30))
def test_tensorstore_reads_the_pytrees_we_save_more(tmp_path_factory, tree_spec) -> None:
    _in_scratch(tmp_path_factory, _check_saved, tree_spec, child="c")


# -- TensorStore -> ours: databases TensorStore writes --------------------------------------


def _check_database(directory: Any, case: cases.DatabaseCase) -> None:
    cases.build_database(directory, case)
    values = _read_all(directory)
    _assert_index_reads(directory, values, [k.encode() for k in case.absent])
    compressed = _assert_nodes_decode_as_dump(directory)
    configs = [case.config, *(c for c, _ in case.writers)]
    if all(c["compression"] is None for c in configs):
        assert compressed == 0
    elif case.config["compression"] is not None and not case.writers and values:
        assert compressed > 0  # Every node is: handed to dump, not decoded here.


_ZSTD = {"compression": {"id": "zstd"}, "max_inline_value_bytes": 100}
_PLAIN = {"compression": None, "max_inline_value_bytes": 16, "max_decoded_node_bytes": 300}
# Compressed writers' nodes merged under uncompressed ones, versions in version nodes.
_MIXED = cases.DatabaseCase(
    config={**_PLAIN, "version_tree_arity_log2": 1},
    manifest_kind="numbered",
    commits=[{f"k{i}": 40 * i for i in range(20)}, {"k3": None, "k30": 2000}, {"a": 5}],
    writers=[(_ZSTD, {f"w0/{i}": 300 * i for i in range(10)}), (_PLAIN, {"w1/x": 3000})],
    merge_after=1,
    absent=["w", "k300"],
    seed=1,
)


@_examples(60)
@given(case=cases.database_cases())
@example(case=_MIXED)
def test_we_read_what_tensorstore_writes(tmp_path_factory, case) -> None:
    _in_scratch(tmp_path_factory, _check_database, case)


@pytest.mark.slow
@_ON_REQUEST
@_examples(_SLOW_EXAMPLES)
@given(case=cases.database_cases(max_keys=300))
def test_we_read_what_tensorstore_writes_more(tmp_path_factory, case) -> None:
    _in_scratch(tmp_path_factory, _check_database, case)


# -- TensorStore -> ours: pytrees Orbax saves -----------------------------------------------


def _check_orbax(directory: Any, tree_spec: Any, compression: bool, file_size: Any) -> None:
    from orbax.checkpoint import v1 as ocp_v1

    tree = cases.build_tree(tree_spec)
    saving = ocp_v1.options.ArrayOptions.Saving(
        use_compression=compression, ocdbt_target_data_file_size=file_size
    )
    with ocp_v1.Context(array_options=ocp_v1.options.ArrayOptions(saving=saving)):
        ocp_v1.save(directory, tree)
    expected = _arrays(tree)
    loaded = _arrays(cp.load_pytree(directory))
    assert set(loaded) == set(expected)
    for name, array in loaded.items():
        _assert_same_array(array, expected[name], name)


# Orbax saves no zero-size arrays (and then waits for its own threads for minutes), and
# chunks a prime length into one-element chunks (600,000 of them were minutes to read).
_ORBAX_TREES = cases.tree_specs(cases.leaf_specs(driver=False, orbax=True), max_size=6)
_ORBAX_FILE_SIZES = st.none() | st.integers(1 << 16, 1 << 22)


@pytest.mark.orbax
@_examples(8)
@given(tree_spec=_ORBAX_TREES, compression=st.booleans(), file_size=_ORBAX_FILE_SIZES)
def test_we_load_the_pytrees_orbax_saves(tmp_path_factory, tree_spec, compression, file_size):
    _in_scratch(tmp_path_factory, _check_orbax, tree_spec, compression, file_size, child="c")


@pytest.mark.orbax
@pytest.mark.slow
@_ON_REQUEST
@_examples(max(_SLOW_EXAMPLES // 5, 6))
@given(tree_spec=_ORBAX_TREES, compression=st.booleans(), file_size=_ORBAX_FILE_SIZES)
def test_we_load_the_pytrees_orbax_saves_more(tmp_path_factory, tree_spec, compression, file_size):
    _in_scratch(tmp_path_factory, _check_orbax, tree_spec, compression, file_size, child="c")


@pytest.mark.orbax
def test_we_load_orbax_keys_that_end_in_a_slash(tmp_path) -> None:
    from orbax.checkpoint import v1 as ocp_v1

    tree = {"g": {"/": np.arange(3), "x/": np.ones(2)}}
    ocp_v1.save(tmp_path / "c", tree)
    loaded = cp.load_pytree(tmp_path / "c")
    for name, array in _arrays(loaded).items():
        _assert_same_array(array, _arrays(tree)[name], name)
