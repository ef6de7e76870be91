"""The training states JAX users train with, through the real Flax (NNX, linen), Optax and Equinox.

Each is saved, restored the way its library documents (against a fresh state
or its ``eval_shape``), onto another mesh, and in part (parameters only).
Training after a restore continues bit for bit, dropout included.
"""

from __future__ import annotations

import sys

import checkpointables as cp
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training.train_state import TrainState

pytestmark = pytest.mark.slow  # Seconds each: every test compiles a few training steps.
P = jax.sharding.PartitionSpec
X = jnp.arange(32.0).reshape(8, 4) / 32
Y = jnp.ones((8, 1))


def _mesh(shape: tuple[int, int]) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, ("data", "model"))


def _onto(mesh: jax.sharding.Mesh):
    """Abstract leaves on ``mesh``: matrices split along "model", the rest replicated."""

    def place(x):
        spec = P(None, "model") if x.ndim == 2 and x.shape[1] % mesh.shape["model"] == 0 else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.NamedSharding(mesh, spec))

    return lambda tree: jax.tree_util.tree_map(place, tree)


def _assert_same_leaves(a, b) -> None:
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        if jax.dtypes.issubdtype(getattr(y, "dtype", np.float32), jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if not isinstance(y, jax.Array | np.ndarray):
            assert type(x) is type(y)  # Python scalars stay what they were (TrainState.step).
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# -- Flax NNX ------------------------------------------------------------------------------


class _Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear1 = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.linear2 = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear2(self.dropout(self.norm(nnx.relu(self.linear1(x)))))


def _nnx_objects(seed: int) -> tuple[_Net, nnx.Optimizer]:
    model = _Net(nnx.Rngs(seed, dropout=seed + 1))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


@nnx.jit
def _nnx_step(model: _Net, optimizer: nnx.Optimizer) -> jax.Array:
    loss, grads = nnx.value_and_grad(lambda m: ((m(X) - Y) ** 2).mean())(model)
    optimizer.update(model, grads)
    return loss


def _nnx_losses(model: _Net, optimizer: nnx.Optimizer, steps: int = 3) -> list[float]:
    return [float(_nnx_step(model, optimizer)) for _ in range(steps)]


@pytest.mark.parametrize("against", ["fresh", "eval_shape"])
def test_nnx_training_continues_bit_for_bit(tmp_path, against) -> None:
    model, optimizer = _nnx_objects(0)
    _nnx_losses(model, optimizer)
    cp.save_pytree(tmp_path / "c", nnx.state((model, optimizer)))  # RNG keys included
    expected = _nnx_losses(model, optimizer)

    if against == "fresh":
        restored = _nnx_objects(5)
        nnx.update(restored, cp.load_pytree(tmp_path / "c", nnx.state(restored)))
    else:
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: _nnx_objects(5)))
        restored = nnx.merge(graphdef, cp.load_pytree(tmp_path / "c", abstract))
    assert _nnx_losses(*restored) == expected  # Dropout draws the same masks.
    _assert_same_leaves(nnx.state(restored), nnx.state((model, optimizer)))


def test_nnx_objects_saved_whole_load_in_every_natural_form(tmp_path) -> None:
    # Saved as the objects themselves, not nnx.state: their empty `_pytree__state` nodes
    # (and optax's EmptyState) are in the checkpoint, and nnx.state(...) has none of them.
    # Restored into objects of another seed: every value (RNG keys and counts included)
    # must come from the checkpoint. (Training from such a state: the tests above.)
    model, optimizer = _nnx_objects(0)
    cp.save_pytree(tmp_path / "c", (model, optimizer))

    into_state = _nnx_objects(5)
    nnx.update(into_state, cp.load_pytree(tmp_path / "c", nnx.state(into_state)))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: _nnx_objects(5)))
    forms = {
        "nnx.update(objects, load(nnx.state(objects)))": into_state,
        "nnx.merge(graphdef, load(abstract state))": nnx.merge(
            graphdef, cp.load_pytree(tmp_path / "c", abstract)
        ),
        "load(objects)": cp.load_pytree(tmp_path / "c", _nnx_objects(5)),
        "load(nnx.eval_shape(objects))": cp.load_pytree(
            tmp_path / "c", nnx.eval_shape(lambda: _nnx_objects(5))
        ),
    }
    for restored in forms.values():
        assert type(restored[0]) is _Net and type(restored[1]) is nnx.Optimizer
        _assert_same_leaves(nnx.state(restored), nnx.state((model, optimizer)))


def test_nnx_restore_onto_another_mesh_and_params_only(tmp_path) -> None:
    model, optimizer = _nnx_objects(0)
    _nnx_losses(model, optimizer)
    state = nnx.state((model, optimizer))
    shardings = jax.tree_util.tree_map(lambda a: a.sharding, _onto(_mesh((4, 2)))(state))
    cp.save_pytree(tmp_path / "c", jax.device_put(state, shardings))  # saved from a 4x2 mesh
    saved_params = jax.tree_util.tree_map(np.asarray, nnx.state(model, nnx.Param))
    expected = _nnx_losses(model, optimizer)

    mesh = _mesh((2, 4))
    restored = _nnx_objects(5)
    loaded = cp.load_pytree(tmp_path / "c", _onto(mesh)(nnx.state(restored)))
    kernel = loaded[0]["linear1"]["kernel"][...]
    assert kernel.sharding == jax.NamedSharding(mesh, P(None, "model"))
    nnx.update(restored, loaded)
    assert _nnx_losses(*restored) == expected

    # Parameters only: for evaluation, the optimizer and RNG state stay behind.
    evaluated, _ = _nnx_objects(9)
    params = cp.load_pytree(tmp_path / "c", nnx.state((evaluated,), nnx.Param), partial_load=True)
    nnx.update((evaluated,), params)
    _assert_same_leaves(nnx.state(evaluated, nnx.Param), saved_params)


# -- Flax linen + Optax --------------------------------------------------------------------


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(1)(nn.relu(nn.Dense(8)(x)))


OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2),
    "chain-clip-adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    "sgd-momentum": lambda: optax.sgd(1e-2, momentum=0.9),
}


MLP = _Mlp()


def _train_state(seed: int, tx: optax.GradientTransformation) -> TrainState:
    params = MLP.init(jax.random.key(seed), X)["params"]
    return TrainState.create(apply_fn=MLP.apply, params=params, tx=tx)


@jax.jit
def _linen_step(state: TrainState) -> tuple[TrainState, jax.Array]:
    def loss_fn(params):
        return ((state.apply_fn({"params": params}, X) - Y) ** 2).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def _linen_train(state: TrainState, steps: int = 3) -> tuple[TrainState, list[float]]:
    losses = []
    for _ in range(steps):
        state, loss = _linen_step(state)
        losses.append(float(loss))
    return state, losses


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_linen_train_state_round_trips(tmp_path, optimizer) -> None:
    tx = OPTIMIZERS[optimizer]()
    state, _ = _linen_train(_train_state(0, tx))
    cp.save_pytree(tmp_path / "c", state)
    _, expected = _linen_train(state)

    fresh = _train_state(1, tx)
    for abstract in (fresh, jax.eval_shape(lambda: _train_state(1, tx))):
        restored = cp.load_pytree(tmp_path / "c", abstract)
        assert type(restored) is TrainState and restored.tx is tx
        _assert_same_leaves(restored, state)
        assert _linen_train(restored)[1] == expected


def test_optax_state_alone_and_params_subset(tmp_path) -> None:
    tx = OPTIMIZERS["chain-clip-adam"]()
    state, _ = _linen_train(_train_state(0, tx))
    cp.save_pytree(tmp_path / "opt", state.opt_state)
    restored = cp.load_pytree(tmp_path / "opt", jax.eval_shape(tx.init, state.params))
    _assert_same_leaves(restored, state.opt_state)

    cp.save_pytree(tmp_path / "c", state)
    abstract = jax.eval_shape(lambda: _train_state(1, tx))
    params = cp.load_pytree(tmp_path / "c", {"params": abstract.params}, partial_load=True)
    _assert_same_leaves(params["params"], state.params)


def test_linen_restore_onto_another_mesh(tmp_path) -> None:
    tx = OPTIMIZERS["adam"]()
    state, _ = _linen_train(_train_state(0, tx))
    cp.save_pytree(tmp_path / "c", state)
    _, expected = _linen_train(state)
    mesh = _mesh((2, 4))
    abstract = _onto(mesh)(jax.eval_shape(lambda: _train_state(1, tx)))
    restored = cp.load_pytree(tmp_path / "c", abstract)
    kernel = restored.params["Dense_1"]["kernel"]  # (4, 8)
    assert kernel.sharding == jax.NamedSharding(mesh, P(None, "model"))
    assert _linen_train(restored)[1] == expected


# -- Equinox -------------------------------------------------------------------------------


def _eqx_model(seed: int) -> eqx.nn.MLP:
    return eqx.nn.MLP(4, 1, 8, 2, key=jax.random.key(seed))


def test_equinox_partition_and_combine(tmp_path) -> None:
    model = _eqx_model(0)
    params, _ = eqx.partition(model, eqx.is_array)
    cp.save_pytree(tmp_path / "c", {"model": params, "key": jax.random.key(3)})

    fresh_params, fresh_static = eqx.partition(_eqx_model(1), eqx.is_array)
    loaded = cp.load_pytree(tmp_path / "c", {"model": fresh_params, "key": jax.random.key(0)})
    restored = eqx.combine(loaded["model"], fresh_static)
    np.testing.assert_array_equal(np.asarray(jax.vmap(restored)(X)), np.asarray(jax.vmap(model)(X)))
    same_key = jax.random.key_data(loaded["key"]) == jax.random.key_data(jax.random.key(3))
    assert bool(same_key.all())

    # Onto another mesh, through eqx.filter_eval_shape.
    mesh = _mesh((2, 4))
    abstract_model = eqx.filter_eval_shape(_eqx_model, 1)
    is_abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    abstract, abstract_static = eqx.partition(abstract_model, is_abstract)
    loaded = cp.load_pytree(tmp_path / "c", {"model": _onto(mesh)(abstract), "key": cp.PLACEHOLDER})
    assert loaded["model"].layers[0].weight.sharding.mesh == mesh
    restored = eqx.combine(loaded["model"], abstract_static)
    np.testing.assert_allclose(
        np.asarray(jax.vmap(restored)(X)), np.asarray(jax.vmap(model)(X)), rtol=1e-6
    )


def test_an_equinox_model_itself_is_refused_with_what_to_save(tmp_path) -> None:
    model = _eqx_model(0)
    with pytest.raises(cp.errors.NoHandlerForObjectError) as raised:
        cp.save_pytree(tmp_path / "model", model)
    message = str(raised.value)
    assert "Equinox: the tree, an eqx.Module, holds functions" in message
    assert "eqx.filter(model, eqx.is_array)" in message and "docs/recipes.md" in message
    assert "Flax NNX" not in message and not (tmp_path / "model").exists()
    with pytest.raises(cp.errors.NoHandlerForObjectError, match=r"eqx.Module at \['model'\]"):
        cp.save_pytree(tmp_path / "state", {"model": model, "step": 0})
    with pytest.raises(cp.errors.NoHandlerForObjectError, match="eqx.filter"):
        cp.save_checkpointables(tmp_path / "items", {"model": model})

    # As the message says: the filtered arrays, into the same filtered abstract tree.
    cp.save_pytree(tmp_path / "model", eqx.filter(model, eqx.is_array))
    is_abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    abstract, static = eqx.partition(eqx.filter_eval_shape(_eqx_model, 1), is_abstract)
    restored = eqx.combine(cp.load_pytree(tmp_path / "model", abstract), static)
    np.testing.assert_array_equal(np.asarray(jax.vmap(restored)(X)), np.asarray(jax.vmap(model)(X)))


def test_equinox_advice_only_for_a_module_holding_functions(tmp_path, monkeypatch) -> None:
    params = eqx.filter(_eqx_model(0), eqx.is_array)  # Saveable; the bad leaf is elsewhere.
    with pytest.raises(cp.errors.NoHandlerForObjectError) as raised:
        cp.save_pytree(tmp_path / "a", {"model": params, "bad": object()})
    assert "Equinox" not in str(raised.value) and "['bad']" in str(raised.value)
    # Without equinox imported there is no module to find, and nothing imports it.
    monkeypatch.delitem(sys.modules, "equinox")
    with pytest.raises(cp.errors.NoHandlerForObjectError, match="Flax NNX"):
        cp.save_pytree(tmp_path / "b", {"f": print})
    assert "equinox" not in sys.modules


def test_a_linen_module_itself_is_refused_with_what_to_save(tmp_path) -> None:
    # A linen module holds its configuration, not its parameters: the error says to save
    # the state instead, and does not blame options the caller never set.
    with pytest.raises(cp.errors.NoHandlerForObjectError) as raised:
        cp.save_pytree(tmp_path / "model", nn.Dense(3))
    message = str(raised.value)
    assert "flax.linen.linear.Dense" in message and "the variables init returns" in message
    assert not (tmp_path / "model").exists()


def test_a_linen_module_is_refused_with_what_to_save_instead(tmp_path) -> None:
    # A linen Module holds no arrays; an NNX module does, and saves as it is.
    with pytest.raises(cp.errors.NoHandlerForObjectError, match="or a TrainState, not the Module"):
        cp.save_pytree(tmp_path / "linen", nn.Dense(3))
    model, _ = _nnx_objects(0)
    cp.save_pytree(tmp_path / "nnx", model)
    assert cp.is_checkpoint(tmp_path / "nnx")
