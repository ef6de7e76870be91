"""Which tensor a leaf loads: its full key-path name where the file holds it, then the
shortened one (an NNX Variable's ``.value`` dropped, or the checkpoint's dict form), then
the name less a last ``value`` key; and every tree that exports loads back exactly."""

from __future__ import annotations

import dataclasses

import checkpointables as cp
import checkpointables_safetensors
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpointables_safetensors import save_pytree
from flax import nnx
from safetensors.numpy import load_file, save_file


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Lin:
    value: jax.Array


def _sds(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


def _both(path) -> None:
    save_file({"a": np.zeros(2, np.float32), "a.value": np.ones(2, np.float32)}, str(path))


def test_a_leaf_named_a_value_loads_tensor_a_value_not_a(tmp_path) -> None:
    _both(tmp_path / "f.safetensors")
    wanted = jax.ShapeDtypeStruct((2,), jnp.float32)
    for abstract in ({"a": {"value": wanted}}, {"a": Lin(wanted)}, {"a.value": wanted}):
        loaded = cp.load_pytree(tmp_path / "f.safetensors", abstract, partial_load=True)
        assert np.asarray(jax.tree.leaves(loaded)[0]).tolist() == [1.0, 1.0], abstract


def test_an_nnx_variable_loads_its_full_name_first_and_the_short_one_without_it(tmp_path):
    _both(tmp_path / "f.safetensors")
    abstract = {"a": nnx.Param(jax.ShapeDtypeStruct((2,), jnp.float32))}
    loaded = cp.load_pytree(tmp_path / "f.safetensors", abstract, partial_load=True)
    assert np.asarray(loaded["a"][...]).tolist() == [1.0, 1.0]
    save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "g.safetensors"))
    loaded = cp.load_pytree(tmp_path / "g.safetensors", abstract)
    assert np.asarray(loaded["a"][...]).tolist() == [0.0, 0.0]


def test_an_exported_checkpoint_of_a_value_field_loads_back_into_the_tree(tmp_path) -> None:
    tree = {"lin": Lin(jnp.arange(3.0)), "d": {"value": jnp.ones(2)}}
    cp.save_pytree(tmp_path / "ck", tree)
    result = checkpointables_safetensors.export_checkpoint(tmp_path / "ck", tmp_path / "out")
    assert set(load_file(result.files[0])) == {"lin", "d"}  # The dict form: .value dropped
    loaded = cp.load_pytree(tmp_path / "out", jax.tree.map(_sds, tree))
    assert jax.tree.map(lambda x: np.asarray(x).tolist(), loaded) == jax.tree.map(
        lambda x: np.asarray(x).tolist(), tree
    )


def test_two_leaves_of_one_tensor_are_still_refused(tmp_path) -> None:
    save_file({"a.b": np.ones(2, np.float32)}, str(tmp_path / "f.safetensors"))
    wanted = jax.ShapeDtypeStruct((2,), jnp.float32)
    with pytest.raises(cp.errors.TreeMismatchError, match="both name the tensor 'a.b'"):
        cp.load_pytree(tmp_path / "f.safetensors", {"a.b": wanted, "a": {"b": wanted}})
    with pytest.raises(cp.errors.TreeMismatchError, match="both name the tensor 'a.value'"):
        cp.load_pytree(tmp_path / "f.safetensors", {"a.value": wanted, "a": Lin(wanted)})


def test_a_short_name_that_would_load_another_leafs_tensor_is_refused_at_export(tmp_path):
    # x's Variable is written "x", beside the leaf "x.value", which a load of x reads first.
    tree = {"x": nnx.Param(np.zeros(2, np.float32)), "x.value": np.ones(2, np.float32)}
    with pytest.raises(cp.errors.InvalidArgumentError, match="would be written as 'x'"):
        save_pytree(tmp_path / "p", tree)
