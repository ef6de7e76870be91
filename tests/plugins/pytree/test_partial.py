"""``cp.partial``: additions, replacements, metadata, errors, no data copies, Orbax reads it."""

from __future__ import annotations

import os

import checkpointables as cp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpointables.cli import main as cli_main
from checkpointables_example_point import AbstractPoint, Point

P = jax.sharding.PartitionSpec


def _assert_same(loaded, expected) -> None:
    """Same structure, same leaf types, bit-identical arrays."""
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(expected)
    for a, b in zip(
        jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(expected), strict=True
    ):
        if isinstance(b, np.ndarray | jax.Array):
            assert type(a) is type(b) or (isinstance(a, jax.Array) and isinstance(b, jax.Array))
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:
            assert a == b and type(a) is type(b)


def _files(root) -> dict[str, int]:
    return {
        os.path.relpath(os.path.join(d, f), root): os.path.getsize(os.path.join(d, f))
        for d, _, fs in os.walk(root)
        for f in fs
    }


def test_layer_by_layer_additions(tmp_path, mesh_4x2) -> None:
    path = tmp_path / "ckpt"
    sharding = jax.sharding.NamedSharding(mesh_4x2, P("x", "y"))
    layers = {
        f"layer{i}": {
            "w": jax.device_put(jnp.arange(64.0, dtype=jnp.float32).reshape(8, 8) + i, sharding),
            "b": np.full(5, i, np.float16),
        }
        for i in range(3)
    }
    for name, layer in layers.items():
        cp.partial.save(path, {"params": {name: layer}})
        assert not path.exists() and not cp.is_checkpoint(path)
    cp.partial.save(path, {"step": 7, "name": "run", "opt": (1.5, [])})
    session = cp.partial.session_path(path)
    assert session.name == "ckpt.partial_save" and cp.layout.is_temporary_path(session)
    assert not cp.is_checkpoint(session)

    cp.partial.finalize(path)
    assert cp.is_checkpoint(path) and not session.exists()
    expected = {"params": layers, "step": 7, "name": "run", "opt": (1.5, [])}
    loaded = cp.load_pytree(path)
    assert isinstance(loaded["opt"], tuple)
    _assert_same(loaded, expected)

    # With an abstract tree: resharding onto another mesh, NumPy leaves as jax.Arrays.
    abstract = cp.pytree_metadata(path).metadata
    other = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y")), P("y", "x")
    )
    abstract["params"]["layer1"]["w"] = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=other)
    resharded = cp.load_pytree(path, abstract)
    assert resharded["params"]["layer1"]["w"].sharding == other
    np.testing.assert_array_equal(resharded["params"]["layer1"]["w"], layers["layer1"]["w"])
    assert cp.load_pytree(path, {"step": 0}, partial_load=True) == {"step": 7}


def test_replacements(tmp_path) -> None:
    path = tmp_path / "ckpt"
    cp.partial.save(
        path,
        {
            "a": np.arange(4),
            "b": {"x": np.ones(3), "y": "old"},
            "c": 1,
            "d": [1, 2, 3],
            "e": {"k": 1},
            "f": "text",
            "g": {"keep": 1, "drop": 2},
            "h": {"x": 1, "y": 2},
        },
    )
    cp.partial.save(
        path,
        {
            "a": np.zeros((2, 2), np.float32),  # a leaf replaced: new shape and dtype
            "b": 3.5,  # a subtree replaced by a leaf
            "c": {"z": np.arange(2)},  # a leaf replaced by a subtree
            "d": {"0": "dict now"},  # a list replaced by a dict
            "e": {},  # a subtree replaced by an empty dict
            "f": np.ones(2, np.int8),  # a string replaced by an array
            "g": {"drop": None, "new": "n"},  # nested: one key replaced, one added
            "h": 0,
        },
    )
    # A subtree over the leaf that replaced a subtree: the first subtree stays gone.
    cp.partial.save(path, {"a": "finally a string", "d": {"1": 5}, "h": {"z": 3}})
    cp.partial.finalize(path)
    expected = {
        "a": "finally a string",
        "b": 3.5,
        "c": {"z": np.arange(2)},
        "d": {"0": "dict now", "1": 5},
        "e": {},
        "f": np.ones(2, np.int8),
        "g": {"keep": 1, "drop": None, "new": "n"},
        "h": {"z": 3},
    }
    _assert_same(cp.load_pytree(path), expected)
    assert cp.load_pytree(path, {"b": 0.0}, partial_load=True) == {"b": 3.5}
    assert cli_main(["verify", str(path)]) == 0


def test_lists_merge_by_index_and_tuples_follow_the_latest_save(tmp_path) -> None:
    path = tmp_path / "ckpt"
    cp.partial.save(path, {"l": [np.int32(1), np.int32(2), np.int32(3)], "t": (1, 2)})
    cp.partial.save(path, {"l": [np.int32(9)], "t": [5]})
    cp.partial.finalize(path)
    _assert_same(cp.load_pytree(path), {"l": [np.int32(9), np.int32(2), np.int32(3)], "t": [5, 2]})


def test_a_single_leaf_replaces_the_whole_tree(tmp_path) -> None:
    path = tmp_path / "ckpt"
    cp.partial.save(path, {"a": np.ones(3)})
    cp.partial.save(path, np.arange(5))
    cp.partial.finalize(path)
    _assert_same(cp.load_pytree(path), np.arange(5))


def test_custom_metadata_merges_and_later_values_win(tmp_path) -> None:
    path = tmp_path / "ckpt"
    cp.partial.save(path, {"a": 1}, custom_metadata={"run": "x", "cfg": {"lr": 1, "bs": 8}})
    cp.partial.save(path, {"b": 2})
    cp.partial.save(path, {"c": 3}, custom_metadata={"run": "y", "cfg": {"lr": 2}, "new": [1]})
    cp.partial.finalize(path)
    metadata = cp.pytree_metadata(path)
    assert metadata.custom_metadata == {"run": "y", "cfg": {"lr": 2, "bs": 8}, "new": [1]}
    assert metadata.init_timestamp_nsecs <= metadata.commit_timestamp_nsecs


def test_async_saves_apply_in_call_order(tmp_path) -> None:
    path = tmp_path / "ckpt"
    responses = [
        cp.partial.save_async(path, {"v": np.full(1000, i, np.int64), f"k{i}": i}) for i in range(6)
    ]
    cp.partial.finalize(path)  # Waits for them.
    assert all(r.done() for r in responses)
    for r in responses:
        assert r.result() is None
    expected = {"v": np.full(1000, 5, np.int64), **{f"k{i}": i for i in range(6)}}
    _assert_same(cp.load_pytree(path), expected)


def test_finalize_copies_no_array_data(tmp_path) -> None:
    path = tmp_path / "ckpt"
    rng = np.random.default_rng(0)
    big = {f"w{i}": rng.standard_normal((512, 512)) for i in range(4)}  # 2 MiB each
    for name, value in big.items():
        cp.partial.save(path, {name: value})
    cp.partial.save(path, {"w0": rng.standard_normal((512, 512))})  # replaces w0
    session = cp.partial.session_path(path)
    inodes = {}
    for d, _, fs in os.walk(session):
        for f in fs:
            if os.path.getsize(os.path.join(d, f)) > 1 << 20:
                inodes[os.stat(os.path.join(d, f)).st_ino] = f
    assert len(inodes) == 5
    cp.partial.finalize(path)

    files = _files(path)
    array_bytes = sum(v.nbytes for v in big.values())
    # Outside the moved partial saves: only metadata and the merged b-tree.
    root_bytes = sum(size for name, size in files.items() if cp.partial.SOURCE_PREFIX not in name)
    assert root_bytes < 64 * 1024 < array_bytes // 100
    # The data files are the very files the partial saves wrote.
    final_inodes = {os.stat(path / name).st_ino for name, size in files.items() if size > 1 << 20}
    assert final_inodes == set(inodes)
    loaded = cp.load_pytree(path)
    for name in ("w1", "w2", "w3"):
        np.testing.assert_array_equal(loaded[name], big[name])
    assert not np.array_equal(loaded["w0"], big["w0"])


def test_custom_leaf_handler_files_follow_their_leaves(tmp_path) -> None:
    path = tmp_path / "ckpt"
    cp.partial.save(path, {"p": Point(1, 2), "q": Point(3, 4.5), "r": Point(0, 0)})
    cp.partial.save(path, {"p": Point(5, 6)})
    cp.partial.save(path, {"q": np.ones(2)})
    cp.partial.finalize(path)
    loaded = cp.load_pytree(path)
    assert loaded["p"] == Point(5, 6) and loaded["r"] == Point(0, 0)
    np.testing.assert_array_equal(loaded["q"], np.ones(2))
    assert sorted(n for n in os.listdir(path / "pytree") if n.endswith(".json")) == [
        "p.point.json",
        "r.point.json",
    ]
    assert cp.pytree_metadata(path).metadata["p"] == AbstractPoint(int, int)


def test_errors(tmp_path) -> None:
    path = tmp_path / "ckpt"
    with pytest.raises(FileNotFoundError, match="No partial save session"):
        cp.partial.finalize(path)
    with pytest.raises(ValueError, match="None"):
        cp.partial.save(path, None)
    with pytest.raises(cp.errors.NoHandlerForObjectError, match=r"\['bad'\]"):
        cp.partial.save(path, {"ok": 1, "bad": object()})
    with pytest.raises(ValueError, match="custom_metadata"):
        cp.partial.save(path, {"ok": 1}, custom_metadata={"x": object()})
    with pytest.raises(ValueError, match="same string form"):
        cp.partial.save(path, {"1": 1, 1: 2})  # fails in the handler, after resolution
    # Bad input leaves nothing behind, not even an empty session.
    assert os.listdir(tmp_path) == []

    cp.save_pytree(path, {"done": 1})
    with pytest.raises(FileExistsError, match="finished checkpoint"):
        cp.partial.save(path, {"a": 1})
    with pytest.raises(FileExistsError, match="finished checkpoint"):
        cp.partial.finalize(path)

    other = tmp_path / "other"
    cp.partial.save(other, {"a": 1})
    cp.save_pytree(other, {"b": 2})  # Someone else wrote the final path meanwhile.
    with pytest.raises(FileExistsError):
        cp.partial.finalize(other)
    assert cp.load_pytree(other) == {"b": 2}


def test_finalized_path_is_an_ordinary_checkpoint(tmp_path, capsys) -> None:
    path = tmp_path / "ckpt"
    cp.partial.save(path, {"a": np.arange(3), "s": "x"})
    cp.partial.save(path, {"b": jnp.ones(2)}, custom_metadata={"k": 1})
    cp.partial.finalize(path)
    assert cli_main(["inspect", str(path)]) == 0
    assert "['b']" in capsys.readouterr().out
    assert cli_main(["verify", str(path)]) == 0
    assert cp.metadata_checksums.is_protected(path)
    assert set(cp.load_checkpointables(path)) == {"pytree"}
    # A finished checkpoint is never a partial session again.
    with pytest.raises(FileExistsError):
        cp.partial.save(path, {"c": 1})


@pytest.mark.orbax
@pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring:UserWarning")
def test_orbax_loads_a_finalized_checkpoint(tmp_path, mesh_4x2) -> None:
    from orbax.checkpoint import v1 as ocp_v1

    path = tmp_path / "ckpt"
    sharding = jax.sharding.NamedSharding(mesh_4x2, P("x", "y"))
    kernel = jax.device_put(jnp.arange(64.0, dtype=jnp.float32).reshape(8, 8), sharding)
    cp.partial.save(
        path, {"params": {"kernel": kernel, "bias": np.ones(3)}, "name": "r", "step": 1}
    )
    cp.partial.save(path, {"params": {"bias": np.arange(4.0)}, "step": 2, "extra": [0.5]})
    cp.partial.finalize(path)
    expected = {
        "params": {"kernel": kernel, "bias": np.arange(4.0)},
        "name": "r",
        "step": 2,
        "extra": [0.5],
    }
    _assert_same(ocp_v1.load(path), expected)
    abstract = {
        "params": {
            "kernel": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=sharding),
            "bias": np.empty(4),
        },
        "name": "",
        "step": 0,
        "extra": [0.0],
    }
    loaded = ocp_v1.load(path, abstract)
    assert loaded["params"]["kernel"].sharding == sharding
    _assert_same(loaded, expected)


def test_docs_examples_run(tmp_path, monkeypatch) -> None:
    import pathlib
    import re

    page = pathlib.Path(__file__).resolve().parents[3] / "docs" / "partial.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    assert len(blocks) == 4
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(page), "exec"), namespace)
    for name in ("model/ckpt", "fix/ckpt", "async/ckpt"):
        assert cp.is_checkpoint(tmp_path / name)


def test_a_damaged_data_file_of_a_partial_save_is_an_integrity_error(tmp_path) -> None:
    path = tmp_path / "ckpt"
    cp.partial.save(path, {"a": np.arange(4.0), "n": 3})
    cp.partial.save(path, {"b": np.arange(6, dtype=np.int32)})
    piece = cp.partial.session_path(path) / "pytree" / "partial-000001"
    # TensorStore (the fast path off) may write the values in more than one data file.
    for data_file in (piece / "pytree" / "d").iterdir():
        data = bytearray(data_file.read_bytes())
        data[10] ^= 1
        data_file.write_bytes(bytes(data))
    with pytest.raises(cp.errors.IntegrityError, match=f"the partial save {piece} is damaged"):
        cp.partial.finalize(path)
    assert not cp.is_checkpoint(path)


def test_finalize_leaves_the_partial_saves_files_as_recorded(tmp_path) -> None:
    """The merged ``_btree_checksums`` is the merge's own file: were it a hard link to the
    latest save's, rewriting it would damage that save (a resumed finalize refuses it)."""
    path = tmp_path / "ckpt"
    cp.partial.save(path, {"a": np.arange(4.0)})
    cp.partial.save(path, {"b": np.arange(3.0)})
    cp.partial.finalize(path)
    for piece in ("partial-000001", "partial-000002"):
        assert cp.metadata_checksums.verify(path / "pytree" / piece) == []
