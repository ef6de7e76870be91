"""Loads without a budget read large arrays this library wrote as byte ranges, straight into
the arrays being loaded (``Reader._run_unbounded``): a sharded array is not read whole onto
the host first and then cut into its regions (twice the state on the host)."""

from __future__ import annotations

import checkpointables as cp
import jax
import numpy as np
import pytest
from checkpointables_pytree import io
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.plugins.pytree.damage import flip
from tests.traced_memory import TracedPeak

STATE = 32 << 20  # Four arrays of 8 MiB: each above io.UNBOUNDED_STREAM_BYTES.


def _saved(tmp_path) -> tuple[str, dict, dict]:
    mesh = jax.make_mesh((8,), ("x",))
    rows = NamedSharding(mesh, P("x"))
    host = {f"w{i}": np.arange(STATE // 16, dtype=np.float32) + i for i in range(4)}
    path = str(tmp_path / "ckpt")
    cp.save_pytree(path, {k: jax.device_put(v, rows) for k, v in host.items()})
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rows) for k, v in host.items()}
    return path, host, abstract


@pytest.mark.fast_path  # Chunks located by our own index.
def test_a_sharded_load_without_a_budget_holds_the_state_about_once(tmp_path) -> None:
    assert getattr(io, "UNBOUNDED_STREAM_BYTES", 0) <= STATE // 4
    path, host, abstract = _saved(tmp_path)
    cp.load_pytree(path, abstract)  # Warm-up: imports, thread pools.
    with TracedPeak() as traced:
        loaded = cp.load_pytree(path, abstract)
        jax.block_until_ready(loaded)
    for k, v in host.items():
        np.testing.assert_array_equal(np.asarray(loaded[k]), v)
        assert loaded[k].sharding == abstract[k].sharding
    # Read whole, then cut into the regions: twice the state (and more). Read as ranges into
    # the regions' own buffers (which the CPU devices take over): the state, once.
    assert traced.peak < 1.3 * STATE, traced.peak >> 20


@pytest.mark.fast_path
def test_a_damaged_chunk_fails_a_load_without_a_budget(tmp_path) -> None:
    path, _, abstract = _saved(tmp_path)
    data = max((tmp_path / "ckpt" / "pytree" / "d").iterdir(), key=lambda f: f.stat().st_size)
    flip(data, data.stat().st_size // 3)  # A byte of some array's data.
    with pytest.raises(cp.errors.IntegrityError):
        cp.load_pytree(path, abstract)


@pytest.mark.fast_path
def test_a_resharded_load_without_a_budget_holds_few_pieces(tmp_path) -> None:
    """Resharded, a piece is no block of one region: it is read into a buffer, then copied
    into the regions. Without a budget at most ``io.UNBOUNDED_LIMIT`` of them are in flight,
    in pieces of a few MiB (before: 32 MiB pieces, 128 MiB in flight)."""
    mesh = jax.make_mesh((8,), ("x",))
    saved = NamedSharding(jax.make_mesh((2,), ("x",), devices=jax.devices()[:2]), P("x"))
    wanted = NamedSharding(mesh, P(None, "x"))
    host = np.arange(STATE // 4, dtype=np.float32).reshape(256, -1)  # Two chunks of 16 MiB.
    path = str(tmp_path / "ckpt")
    cp.save_pytree(path, {"w": jax.device_put(host, saved)})
    abstract = {"w": jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=wanted)}
    cp.load_pytree(path, abstract)  # Warm-up: imports, thread pools.
    with TracedPeak() as traced:
        loaded = cp.load_pytree(path, abstract)
        jax.block_until_ready(loaded)
    np.testing.assert_array_equal(np.asarray(loaded["w"]), host)
    assert loaded["w"].sharding == wanted
    # The state in its regions' buffers, and the pieces in flight (two chunks at once): 32
    # MiB of them before, the two chunks whole.
    assert traced.peak < STATE + (16 << 20), traced.peak >> 20
