"""Flax NNX states and Hugging Face names: a Variable's ``.value`` is no part of a tensor name.

With Flax 0.12, ``nnx.state(model)``'s key paths end in ``.value`` (the
Variable's pytree flattening); the tensor names are those of
``nnx.to_pure_dict`` (``l.kernel``), both ways, from Python and the command line.
"""

from __future__ import annotations

import dataclasses

import checkpointables as cp
import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from checkpointables import cli
from checkpointables_safetensors import _names, save_pytree
from flax import nnx
from safetensors.numpy import load_file, save_file

from .files import same_bits


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(8, 2, rngs=rngs)])


def _filled(shape: jax.ShapeDtypeStruct):
    if jax.dtypes.issubdtype(shape.dtype, jax.dtypes.prng_key):
        return jax.random.key(0)
    return np.arange(np.prod(shape.shape), dtype=shape.dtype).reshape(shape.shape)


def new_model() -> Model:
    """A ``Model`` holding arange values: built without its initializers, which compile
    random number generation for seconds on CPU."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Model(nnx.Rngs(0, dropout=1))))
    return nnx.merge(graphdef, jax.tree.map(_filled, state))


def pure_names(state: nnx.State) -> set[str]:
    """The names ``nnx.to_pure_dict`` gives ``state``'s leaves, keys joined with dots."""
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
    return {_names.name_of(keypath) for keypath, _ in flat}


def hf_file(path) -> dict[str, np.ndarray]:
    """A Hugging Face-style file for ``Model``'s parameters, written by safetensors itself."""
    tensors = {
        "l.kernel": np.arange(32, dtype=np.float32).reshape(4, 8),
        "l.bias": np.full(8, 0.5, np.float32),
        "norm.scale": np.full(8, 2.0, np.float32),
        "norm.bias": np.zeros(8, np.float32),
        "blocks.0.kernel": np.ones((8, 2), np.float32),
        "blocks.0.bias": np.zeros(2, np.float32),
    }
    save_file(tensors, str(path))
    return tensors


def abstract_params() -> nnx.State:
    return nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(0))), nnx.Param)


def test_save_pytree_of_an_nnx_state_writes_the_pure_dict_names(tmp_path) -> None:
    model = new_model()
    params = nnx.state(model, nnx.Param)
    written = load_file(save_pytree(tmp_path / "p", params).files[0])
    assert set(written) == pure_names(params) and "l.kernel" in written
    assert same_bits(written["l.kernel"], model.l.kernel[...])
    result = save_pytree(tmp_path / "all", nnx.state(model))  # RNG state and batch stats too
    assert set(load_file(result.files[0])) == pure_names(nnx.state(model)) - {"dropout.rngs.key"}
    assert result.skipped == ("['dropout']['rngs']['key'].value",)


def test_a_checkpoint_of_an_nnx_state_exports_the_names_python_does(tmp_path, capsys) -> None:
    model = new_model()
    cp.save_pytree(tmp_path / "ckpt", nnx.state(model))  # Recorded as dicts {"value": array}
    python = set(load_file(save_pytree(tmp_path / "py", nnx.state(model)).files[0]))
    out = tmp_path / "cli" / "model.safetensors"
    assert cli.main(["export", str(tmp_path / "ckpt"), str(out)]) == 0
    assert set(load_file(out)) == python
    assert "['dropout']['rngs']['key']['value']" in capsys.readouterr().out  # skipped
    # Loaded without an abstract tree: the same dicts, the same names.
    loaded = cp.load_pytree(tmp_path / "ckpt")
    assert set(load_file(save_pytree(tmp_path / "re", loaded).files[0])) == python
    for subtree, names in [("l", {"bias", "kernel"}), ("l.kernel", {"kernel"})]:
        argv = ["export", str(tmp_path / "ckpt"), str(out), "--subtree", subtree, "--overwrite"]
        assert cli.main(argv) == 0
        assert set(load_file(out)) == names


def test_hugging_face_names_are_found_for_nnx_leaves(tmp_path) -> None:
    tensors = hf_file(tmp_path / "hf.safetensors")
    names = _names.tensor_names(abstract_params(), tensors)
    assert set(names) == set(tensors)
    # A file exported before Variables were recognised (names ending in .value) still loads.
    old = {f"{name}.value": value for name, value in tensors.items()}
    assert set(_names.tensor_names(abstract_params(), old)) == set(old)


def test_a_hugging_face_file_loads_into_an_nnx_state_and_round_trips(tmp_path) -> None:
    tensors = hf_file(tmp_path / "hf.safetensors")
    params = cp.load_pytree(tmp_path / "hf.safetensors", abstract_params())
    model = new_model()
    nnx.update(model, params)
    assert same_bits(model.l.kernel[...], tensors["l.kernel"])
    save_pytree(tmp_path / "out", nnx.state(model, nnx.Param))
    again = cp.load_pytree(tmp_path / "out", abstract_params())
    assert same_bits(again["blocks"][0]["kernel"][...], tensors["blocks.0.kernel"])
    old = {f"{name}.value": value for name, value in tensors.items()}
    save_file(old, str(tmp_path / "old.safetensors"))
    older = cp.load_pytree(tmp_path / "old.safetensors", abstract_params())
    assert same_bits(older["norm"]["scale"][...], tensors["norm.scale"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Scaled:
    """A user's own node with a ``value`` attribute: not an NNX Variable."""

    value: jax.Array


class EqxLayer(eqx.Module):
    value: jax.Array
    bias: jax.Array


def test_other_trees_keep_their_value_keys(tmp_path) -> None:
    ones = np.ones(2, np.float32)
    trees = {
        "own": {"a": Scaled(ones)},
        "equinox": {"a": EqxLayer(ones, ones)},
        "dicts": {"a": {"value": ones, "bias": ones}},  # Not a Variable's lone entry
        "mixed": {"a": {"value": ones}, "b": ones},  # Not every leaf of that form
        "top": {"value": ones},  # No name may be empty: a top-level "value" stays
        "optax": optax.adam(1e-3).init({"w": ones}),
    }
    for label, tree in trees.items():
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        written = load_file(save_pytree(tmp_path / label, tree).files[0])
        assert set(written) == {_names.name_of(keypath) for keypath, _ in flat}, label


def test_the_checkpoint_form_is_named_as_documented_and_collisions_are_refused(tmp_path) -> None:
    ones = np.ones(2, np.float32)
    # Every leaf the lone "value" of a dict: the form a checkpoint of nnx.state records.
    written = load_file(save_pytree(tmp_path / "d", {"a": {"value": ones}}).files[0])
    assert set(written) == {"a"}
    clash = {"a": {"b": nnx.Param(ones)}, "a.b": nnx.Param(ones)}
    with pytest.raises(cp.errors.InvalidArgumentError, match="Two leaves are both named 'a.b'"):
        save_pytree(tmp_path / "c", clash)
