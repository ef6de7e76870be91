"""The Checkpointer with pytrees of jax.Arrays (needs the pytree plugin)."""

from __future__ import annotations

import checkpointables as cp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

D = cp.training.save_decision_policies
P = cp.training.preservation_policies


@pytest.fixture(autouse=True)
def _needs_pytree() -> None:
    try:
        cp.handlers.get("pytree")
    except cp.errors.CheckpointError:
        pytest.skip("needs the pytree plugin (checkpointables-pytree)")


def same(a, b) -> bool:
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    return tree_a == tree_b and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(leaves_a, leaves_b, strict=True)
    )


def sharded_state(mesh: Mesh, step: int) -> dict:
    sharding = NamedSharding(mesh, PartitionSpec("x"))
    w = jax.device_put(jnp.arange(16.0, dtype=jnp.float32).reshape(8, 2) + step, sharding)
    return {"w": w, "count": jnp.asarray(step, jnp.int32)}


def test_the_issue_example_with_sharded_state_resumes(tmp_path) -> None:
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    init_state = sharded_state(mesh, 0)
    abstract_state = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), init_state
    )

    def train_step(state):
        new = {"w": state["w"] * 0.5 + 1.0, "count": state["count"] + 1}
        return new, jnp.sum(new["w"]) / 100.0

    def train(num_steps):
        policy = D.EveryNStepsPolicy(steps=10)
        keep = P.AnyPreservationPolicy(
            [P.LatestN(3), P.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=2)]
        )
        with cp.training.Checkpointer(
            tmp_path, save_decision_policy=policy, preservation_policy=keep
        ) as ckptr:
            start = ckptr.latest_step()
            state = ckptr.load_pytree(start.step, abstract_state) if start else init_state
            for step in range(start.step + 1 if start else 0, num_steps):
                state, loss = train_step(state)
                ckptr.save_pytree_async(step, state, metrics={"loss": loss})
        return start, state

    start, _ = train(35)
    assert start is None
    start, resumed = train(61)
    assert start.step == 30
    uninterrupted = init_state
    for _ in range(61):
        uninterrupted, _ = train_step(uninterrupted)
    assert same(resumed, uninterrupted)
    ckptr = cp.training.Checkpointer(tmp_path)
    assert [s.step for s in ckptr.steps()] == [40, 50, 60]
    restored = ckptr.load_pytree(60, abstract_state)
    assert restored["w"].sharding == abstract_state["w"].sharding
    assert isinstance(ckptr.latest_step().metrics["loss"], float)


def test_pytree_round_trip_names_metadata_and_free_functions(tmp_path) -> None:
    state = {"a": jnp.arange(5, dtype=jnp.int16), "b": {"c": np.full(3, 1.5, np.float32)}}
    ckptr = cp.training.Checkpointer(tmp_path, save_decision_policy=D.EveryNStepsPolicy(1))
    assert ckptr.save_pytree(0, state)
    assert ckptr.save_pytree_async(1, state, checkpointable_name="params").result()
    assert same(ckptr.load_pytree(0), state)
    assert same(ckptr.load_pytree_async(1, checkpointable_name="params").result(), state)
    assert same(ckptr.load_pytree(1), state)  # The only pytree present is found by itself.
    abstract = ckptr.metadata(0).metadata
    loaded = ckptr.load_pytree(0, abstract)
    assert same(loaded, state)
    assert same(cp.load_pytree(tmp_path / "0"), state)
    with pytest.raises(ValueError, match="None"):
        ckptr.save_pytree(2, None)
    # save/load are the short names.
    assert ckptr.save(2, state) and same(ckptr.load(2), state)
    ckptr.close()


def test_async_save_snapshots_the_state(tmp_path) -> None:
    ckptr = cp.training.Checkpointer(tmp_path, save_decision_policy=D.EveryNStepsPolicy(1))
    host = np.arange(6, dtype=np.float32)
    response = ckptr.save_pytree_async(0, {"x": host})
    host[:] = -1  # The caller may reuse its buffers once save_*_async returns.
    assert response.result()
    assert np.array_equal(ckptr.load_pytree(0)["x"], np.arange(6, dtype=np.float32))
    ckptr.close()
