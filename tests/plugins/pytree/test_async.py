"""Asynchronous saves and loads: host copies in the blocking phase, I/O in the background."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import threading

import checkpointables as cp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpointables._asyncio import waiting_caller
from checkpointables_pytree import ArrayLeafHandler, NumpyLeafHandler
from checkpointables_pytree.leaves import PyTreeSerializationContext, SaveSession

GATE_TIMEOUT = 60


@dataclasses.dataclass
class Gate:
    """A leaf whose background write or read waits until ``event`` is set."""

    event: threading.Event


class GateLeafHandler:
    """Writes nothing; its background phase blocks on the leaf's event."""

    def __init__(self, context: cp.Context | None = None) -> None:
        del context

    async def serialize(self, params, serialization_context):
        events = [p.value.event for p in params]

        async def write() -> None:
            for event in events:
                assert await asyncio.to_thread(event.wait, GATE_TIMEOUT)

        return write()

    async def deserialize(self, params, deserialization_context):
        events = [p.value.event for p in params]

        async def read():
            for event in events:
                assert await asyncio.to_thread(event.wait, GATE_TIMEOUT)
            return [Gate(e) for e in events]

        return read()

    async def metadata(self, params, deserialization_context):
        return [None for _ in params]


@pytest.fixture
def gated_context():
    registry = cp.serialization.StandardLeafHandlerRegistry()
    registry.add(Gate, Gate, GateLeafHandler)
    with cp.Context(
        pytree_options=cp.options.PyTreeOptions(leaf_handler_registry=registry)
    ) as context:
        yield context


def test_caller_may_delete_and_mutate_right_after_save_async_returns(
    tmp_path, gated_context, mesh_4x2
) -> None:
    sharding = jax.sharding.NamedSharding(mesh_4x2, jax.sharding.PartitionSpec("x", "y"))
    big = np.arange(1 << 19, dtype=np.float32).reshape(1024, 512)  # 2 MiB: the zarr3 driver path
    tree = {
        "small_np": np.arange(10.0),
        "big_np": big.copy(),
        "small_jax": jnp.arange(6.0),
        "big_jax": jax.device_put(big, sharding),
        "gate": Gate(threading.Event()),
    }
    response = cp.save_pytree_async(tmp_path / "c", tree)
    # The background phase is held by the gate: nothing is committed yet.
    assert not response.done() and not (tmp_path / "c").exists()
    tree["small_np"][:] = -1
    tree["big_np"][:] = -1
    tree["small_jax"].delete()
    tree["big_jax"].delete()
    tree["gate"].event.set()
    response.result(timeout=GATE_TIMEOUT)
    abstract = {
        "small_np": np.empty(10),
        "big_np": np.empty(big.shape, np.float32),
        "small_jax": jax.ShapeDtypeStruct((6,), jnp.float32),
        "big_jax": jax.ShapeDtypeStruct(big.shape, jnp.float32, sharding=sharding),
        "gate": Gate(threading.Event()),
    }
    abstract["gate"].event.set()
    loaded = cp.load_pytree(tmp_path / "c", abstract)
    np.testing.assert_array_equal(loaded["small_np"], np.arange(10.0))
    np.testing.assert_array_equal(loaded["big_np"], big)
    np.testing.assert_array_equal(np.asarray(loaded["small_jax"]), np.arange(6.0))
    np.testing.assert_array_equal(np.asarray(loaded["big_jax"]), big)


def test_a_donating_step_right_after_save_async_does_not_change_what_is_saved(
    tmp_path, gated_context
) -> None:
    """The training-loop pattern: save asynchronously, then a jitted step donates the state."""
    step = jax.jit(lambda x: x * 0 - 1, donate_argnums=0)
    params = {f"w{i}": jnp.arange(256, dtype=jnp.float32) + i for i in range(20)}
    expected = {k: np.array(v) for k, v in params.items()}
    gate = Gate(threading.Event())
    response = cp.save_pytree_async(tmp_path / "c", {"params": params, "gate": gate})
    params = {k: step(v) for k, v in params.items()}  # Held by the gate: nothing written yet.
    garbage = [jnp.full((256,), 7.0) for _ in range(100)]  # Would reuse freed buffers.
    gate.event.set()
    response.result(timeout=GATE_TIMEOUT)
    loaded = cp.load_pytree(tmp_path / "c", {"params": expected, "gate": _open_gate()})
    for name, value in expected.items():
        np.testing.assert_array_equal(loaded["params"][name], value, err_msg=name)
    assert all(float(v[0]) == -1 for v in params.values()) and garbage


def _open_gate() -> Gate:
    gate = Gate(threading.Event())
    gate.event.set()
    return gate


def test_load_async_returns_before_reading(tmp_path, gated_context) -> None:
    saved_gate = Gate(threading.Event())
    saved_gate.event.set()
    cp.save_pytree(tmp_path / "c", {"a": np.arange(100.0), "gate": saved_gate})
    # A gated leaf holds the background read: load_pytree_async has already returned.
    held = Gate(threading.Event())
    response = cp.load_pytree_async(tmp_path / "c", {"a": np.empty(100), "gate": held})
    assert not response.done()
    held.event.set()
    np.testing.assert_array_equal(response.result(timeout=GATE_TIMEOUT)["a"], np.arange(100.0))


def test_load_async_reads_arrays_in_the_background(tmp_path) -> None:
    # Damage the data: the error surfaces from result(), not from load_pytree_async, so the
    # arrays are read after it returned.
    cp.save_pytree(tmp_path / "c", {"a": np.arange(1000.0)})
    data_dir = tmp_path / "c" / "pytree" / "d"
    (biggest,) = sorted(data_dir.iterdir(), key=lambda p: p.stat().st_size)[-1:]
    raw = bytearray(biggest.read_bytes())
    raw[len(raw) // 3] ^= 0x10
    biggest.write_bytes(bytes(raw))
    response = cp.load_pytree_async(tmp_path / "c")
    with pytest.raises(cp.errors.IntegrityError):
        response.result(timeout=GATE_TIMEOUT)


def _planned_chunk(handler, array, tmp_path) -> np.ndarray:
    """The host data a leaf handler's blocking phase hands to the writer."""
    directory = cp.path.PathAwaitingCreation(tmp_path / "never-created", lambda: None)
    session = SaveSession.create(directory, cp.context.get_context())
    context = PyTreeSerializationContext(parent_dir=directory, session=session)
    param = cp.serialization.SerializationParam(keypath=(jax.tree_util.DictKey("a"),), value=array)
    awaitable = asyncio.run(handler.serialize([param], context))
    awaitable.close()
    session.plan()  # The layouts recorded after the caller got control back (no copy there).
    (item,) = session.writer._items
    ((_, data),) = item.chunks
    return data


def test_only_async_saves_copy_numpy_arrays(tmp_path) -> None:
    array = np.arange(16.0)
    with waiting_caller():  # A synchronous save: the caller waits, so no copy.
        assert np.shares_memory(_planned_chunk(NumpyLeafHandler(), array, tmp_path), array)
    assert not np.shares_memory(_planned_chunk(NumpyLeafHandler(), array, tmp_path), array)
    assert not os.path.exists(tmp_path / "never-created")


def test_jax_arrays_are_never_copied_on_cpu(tmp_path) -> None:
    # The host view keeps the device buffer alive through delete(), so even an
    # asynchronous save can write from it.
    array = jnp.arange(16.0) * 2
    data = _planned_chunk(ArrayLeafHandler(), array, tmp_path)
    assert np.shares_memory(data, np.asarray(array))
    array.delete()
    np.testing.assert_array_equal(data, np.arange(16.0) * 2)


def _many_small(count: int = 40) -> dict[str, jax.Array]:
    return {f"w{i:02d}": jnp.arange(8.0) + i for i in range(count)}


def test_a_deleted_leaf_among_many_is_named_before_save_async_returns(tmp_path) -> None:
    tree = _many_small()
    tree["w17"].delete()
    for name in ("a", "b"):  # The second save reuses the structure's cached plan.
        with pytest.raises(cp.errors.NoHandlerForObjectError, match=r"\['w17'\].*deleted"):
            cp.save_pytree_async(tmp_path / name, tree)
        assert not (tmp_path / name).exists()


def test_a_dtype_zarr3_lacks_is_named_before_save_async_returns(tmp_path) -> None:
    tree = _many_small()
    tree["w05"] = jnp.zeros(4, dtype=jnp.dtype("uint2"))
    with pytest.raises(cp.errors.NoHandlerForObjectError, match=r"\['w05'\].*uint2"):
        cp.save_pytree_async(tmp_path / "c", tree)
    assert not (tmp_path / "c").exists()


def test_single_device_and_sharded_leaves_deleted_right_after_return(
    tmp_path, gated_context, mesh_4x2
) -> None:
    sharding = jax.sharding.NamedSharding(mesh_4x2, jax.sharding.PartitionSpec("x"))
    tree = {**_many_small(), "sharded": jax.device_put(np.arange(64.0), sharding)}
    expected = {k: np.array(v) for k, v in tree.items()}
    gate = Gate(threading.Event())
    response = cp.save_pytree_async(tmp_path / "c", {"t": tree, "gate": gate})
    for value in tree.values():
        value.delete()
    gate.event.set()
    response.result(timeout=GATE_TIMEOUT)
    loaded = cp.load_pytree(tmp_path / "c", {"t": expected, "gate": _open_gate()})
    for name, value in expected.items():
        np.testing.assert_array_equal(loaded["t"][name], value, err_msg=name)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_as_the_caller_left_it_once_an_async_save_is_done(
    tmp_path, enabled
) -> None:
    # The save pauses it in its blocking phase and while planning in the background.
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        response = cp.save_pytree_async(tmp_path / "c", _many_small())
        response.result(timeout=GATE_TIMEOUT)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
