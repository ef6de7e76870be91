"""Pytree nodes with no children round-trip, with and without an abstract tree.

Empty named tuples (``optax.EmptyState``), empty ``flax.struct`` dataclasses
and other registered nodes with no children are part of real training states.
"""

from __future__ import annotations

import collections
import json

import checkpointables as cp
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

Empty = collections.namedtuple("Empty", [])


@flax.struct.dataclass
class NoFields:
    pass


@flax.struct.dataclass
class OnlyStatic:
    name: str = flax.struct.field(pytree_node=False, default="static")


@jax.tree_util.register_pytree_with_keys_class
class Bag:
    """A custom node holding a list of children (possibly none)."""

    def __init__(self, items):
        self.items = list(items)

    def tree_flatten_with_keys(self):
        return [(jax.tree_util.SequenceKey(i), x) for i, x in enumerate(self.items)], None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children)

    def __eq__(self, other):
        return isinstance(other, Bag) and len(other.items) == len(self.items)


def _tree():
    return {
        "e": Empty(),
        "s": NoFields(),
        "static": OnlyStatic(),
        "bag": Bag([]),
        "nested": {"inner": [Empty(), np.arange(3)]},
        "w": np.ones(2, np.float32),
    }


def _recorded(path) -> dict[tuple[str, ...], str]:
    document = json.loads((path / "pytree" / "_METADATA").read_text())
    return {
        tuple(k["key"] for k in v["key_metadata"]): v["value_metadata"]["value_type"]
        for v in document["tree_metadata"].values()
    }


def test_empty_nodes_are_recorded(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", _tree())
    recorded = _recorded(tmp_path / "c")
    assert recorded[("e",)] == "NamedTuple"
    assert recorded[("s",)] == recorded[("static",)] == recorded[("bag",)] == "Dict"
    assert recorded[("nested", "inner", "0")] == "NamedTuple"


def test_with_the_abstract_tree_they_come_back_as_themselves(tmp_path) -> None:
    tree = _tree()
    cp.save_pytree(tmp_path / "c", tree)
    abstract = jax.tree_util.tree_map(lambda x: np.empty(x.shape, x.dtype), tree)
    loaded = cp.load_pytree(tmp_path / "c", abstract)
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(tree)
    assert loaded["e"] == Empty() and type(loaded["e"]) is Empty
    assert type(loaded["s"]) is NoFields and loaded["static"] == OnlyStatic()
    assert type(loaded["bag"]) is Bag and loaded["bag"].items == []
    np.testing.assert_array_equal(loaded["nested"]["inner"][1], np.arange(3))


def test_without_an_abstract_tree_they_come_back_as_empty_dicts(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", _tree())
    loaded = cp.load_pytree(tmp_path / "c")
    # Non-empty named tuples and custom nodes load as dicts of their children: so do empty ones.
    assert loaded["e"] == loaded["s"] == loaded["static"] == loaded["bag"] == {}
    assert loaded["nested"]["inner"][0] == {}
    metadata = cp.pytree_metadata(tmp_path / "c").metadata
    assert metadata["e"] == {} and metadata["nested"]["inner"][0] == {}


def test_an_empty_node_as_the_whole_tree(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", optax.EmptyState())
    assert cp.load_pytree(tmp_path / "c", optax.EmptyState()) == optax.EmptyState()
    assert cp.load_pytree(tmp_path / "c") == {}


def test_the_issue_example(tmp_path) -> None:
    E = collections.namedtuple("E", [])
    cp.save_pytree(tmp_path / "c", {"e": E(), "w": np.ones(2)})
    loaded = cp.load_pytree(tmp_path / "c", {"e": E(), "w": np.empty(2)})
    assert loaded["e"] == E() and type(loaded["e"]) is E


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.adam(1e-3),
        lambda: optax.adamw(1e-3),
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
        lambda: optax.sgd(1e-2, momentum=0.9),
    ],
    ids=["adam", "adamw", "chain-clip-adam", "sgd-momentum"],
)
def test_optax_states_through_eval_shape(tmp_path, make) -> None:
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    tx = make()
    state = tx.init(params)
    _, state = tx.update(jax.tree_util.tree_map(jnp.ones_like, params), state, params)
    cp.save_pytree(tmp_path / "c", state)
    loaded = cp.load_pytree(tmp_path / "c", jax.eval_shape(tx.init, params))
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(state)
    leaves = zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(state), strict=True)
    for a, b in leaves:
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_abstract_tree_may_leave_out_empty_nodes_not_leaves(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", {"e": Empty(), "w": np.ones(2)})
    # The checkpoint's empty node may be missing from the abstract tree: it holds no data
    # (a Flax NNX module saved whole loads into nnx.state(model), which has none of its
    # empty `_pytree__state` nodes). The result follows the abstract tree.
    assert cp.load_pytree(tmp_path / "c", {"w": np.empty(2)}).keys() == {"w"}
    assert cp.load_pytree(tmp_path / "c", {"w": np.empty(2)}, partial_load=True).keys() == {"w"}
    # A leaf the abstract tree leaves out still is an error.
    with pytest.raises(cp.errors.TreeMismatchError, match=r"\['w'\]"):
        cp.load_pytree(tmp_path / "c", {"e": Empty()})
    # A leaf where the checkpoint holds an empty node is a structure mismatch.
    with pytest.raises(cp.errors.TreeMismatchError, match=r"\['e'\] \(an empty"):
        cp.load_pytree(tmp_path / "c", {"e": np.empty(2), "w": np.empty(2)})
    # Leaves where the checkpoint holds an empty node are not in the checkpoint.
    with pytest.raises(cp.errors.TreeMismatchError, match=r"\['e'\]\['x'\]"):
        cp.load_pytree(tmp_path / "c", {"e": {"x": np.empty(2)}, "w": np.empty(2)})


def test_an_empty_node_the_checkpoint_lacks_holds_no_data(tmp_path) -> None:
    # Checkpoints written before empty nodes were recorded (and Orbax's, which may drop
    # them) load into abstract trees that have them.
    cp.save_pytree(tmp_path / "c", {"w": np.ones(2)})
    loaded = cp.load_pytree(tmp_path / "c", {"s": NoFields(), "w": np.empty(2)})
    assert type(loaded["s"]) is NoFields
