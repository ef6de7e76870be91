"""Dict keys keep their type through a save and a load without an abstract tree.

``_METADATA`` records every key as a string (Orbax's format); the paths of
``int`` dict keys are recorded too, so ``{0: x}`` loads as ``{0: x}``, not
``{"0": x}``. Orbax still reads such checkpoints (with string keys, as it
always has), and checkpoints without the record load as before.
"""

from __future__ import annotations

import json

import checkpointables as cp
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from orbax.checkpoint import v1 as ocp_v1

from tests.metadata_edits import with_metadata_checksums_recomputed

_LEAVES = st.one_of(
    st.integers(-(2**31), 2**31 - 1),
    st.floats(allow_nan=False, width=32),
    st.text(max_size=4),
    st.builds(lambda n: np.arange(n, dtype=np.float32), st.integers(0, 3)),
)
# Keys of one dict are all ints or all strings: jax cannot sort a dict whose keys mix them.
_KEYS = st.one_of(
    st.sets(st.integers(-3, 12), min_size=1, max_size=3),
    st.sets(st.sampled_from(["0", "1", "a", "b.c", "w"]), min_size=1, max_size=3),
)


def _dict(children: st.SearchStrategy) -> st.SearchStrategy:
    return _KEYS.flatmap(lambda keys: st.fixed_dictionaries({k: children for k in sorted(keys)}))


_TREES = st.recursive(
    _LEAVES,
    lambda children: st.one_of(
        _dict(children),
        st.lists(children, min_size=1, max_size=3),
        st.lists(children, min_size=1, max_size=3).map(tuple),
    ),
    max_leaves=8,
)


def _edit_metadata(checkpoint, edit) -> None:
    """Edits the pytree's ``_METADATA`` document, and records the checksums again."""
    file = checkpoint / "pytree" / "_METADATA"
    document = json.loads(file.read_text())
    edit(document)
    file.write_text(json.dumps(document))
    with_metadata_checksums_recomputed(checkpoint)


def _assert_same(loaded, expected) -> None:
    """Equal trees: the same containers, the same keys of the same types, equal leaves."""
    assert type(loaded) is type(expected)
    if isinstance(expected, dict):
        assert [(k, type(k)) for k in sorted(loaded)] == [(k, type(k)) for k in sorted(expected)]
        for k in expected:
            _assert_same(loaded[k], expected[k])
    elif isinstance(expected, (list, tuple)):
        assert len(loaded) == len(expected)
        for a, b in zip(loaded, expected, strict=True):
            _assert_same(a, b)
    else:
        np.testing.assert_array_equal(np.asarray(loaded), np.asarray(expected))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(tree=_TREES.filter(lambda t: isinstance(t, (dict, list, tuple))))
def test_a_tree_loads_with_its_key_types(tmp_path_factory, tree) -> None:
    path = tmp_path_factory.mktemp("c") / "c"
    cp.save_pytree(path, tree)
    loaded = cp.load_pytree(path)
    _assert_same(loaded, tree)
    # The metadata tree (what an abstract tree is built from) has the same keys.
    metadata = cp.pytree_metadata(path).metadata
    assert jax.tree_util.tree_structure(metadata) == jax.tree_util.tree_structure(tree)


def test_int_keys_next_to_empty_nodes_and_in_a_custom_dict_node(tmp_path) -> None:
    tree = {0: {}, 1: None, 2: {10: np.ones(2), "x": [{3: 1.5}]}, "s": {"0": 1}}
    # {10: ..., "x": ...} mixes key types: jax cannot flatten it, the save walks it in order.
    cp.save_pytree(tmp_path / "c", tree)
    loaded = cp.load_pytree(tmp_path / "c")
    assert set(loaded[2]) == {10, "x"}
    assert loaded[0] == {} and loaded[1] is None and loaded["s"] == {"0": 1}
    assert loaded[2]["x"][0] == {3: 1.5}


@pytest.mark.orbax
def test_orbax_loads_a_tree_with_int_keys(tmp_path) -> None:
    tree = {"layers": {0: np.arange(3.0), 1: np.ones(2)}, "step": 3}
    cp.save_pytree(tmp_path / "c", tree)
    loaded = ocp_v1.load(tmp_path / "c")  # Orbax's own reading: string keys.
    np.testing.assert_array_equal(loaded["layers"]["0"], tree["layers"][0])
    abstract = {"layers": {0: np.zeros(3), 1: np.zeros(2)}, "step": 0}
    loaded = ocp_v1.load(tmp_path / "c", abstract)
    np.testing.assert_array_equal(loaded["layers"][1], tree["layers"][1])


def test_a_checkpoint_without_the_record_loads_string_keys(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", {"layers": {0: 1.0, 1: 2.0}})

    def forget(document):
        document["checkpointables"].pop("int_keys", None)

    _edit_metadata(tmp_path / "c", forget)
    assert cp.load_pytree(tmp_path / "c") == {"layers": {"0": 1.0, "1": 2.0}}


@pytest.mark.parametrize(
    "record",
    [["layers", "0"], [["layers", "x"]], [["nowhere", "0"]], "layers"],
    ids=["not a list of paths", "not an int", "no such key", "not a list"],
)
def test_a_malformed_record_is_a_metadata_error(tmp_path, record) -> None:
    cp.save_pytree(tmp_path / "c", {"layers": {0: 1.0, "x": 2.0}})

    def damage(document):
        document["checkpointables"]["int_keys"] = record

    _edit_metadata(tmp_path / "c", damage)
    with pytest.raises(cp.errors.MetadataError, match="int_keys"):
        cp.load_pytree(tmp_path / "c")


def test_partial_saves_keep_the_int_keys_that_survive(tmp_path) -> None:
    path = tmp_path / "c"
    cp.partial.save(path, {"layers": {0: 1.0}, "opt": {"0": 1}})
    cp.partial.save(path, {"layers": {1: 2.0}, "opt": {"1": 2}})
    cp.partial.save(path, {"replaced": {3: 1}})
    cp.partial.save(path, {"replaced": 3})
    cp.partial.finalize(path)
    loaded = cp.load_pytree(path)
    assert loaded == {"layers": {0: 1.0, 1: 2.0}, "opt": {"0": 1, "1": 2}, "replaced": 3}
    _assert_same(loaded["layers"], {0: 1.0, 1: 2.0})
