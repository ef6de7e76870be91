"""A ``jax.Array`` object on accelerators saved by a reusing save keeps its fingerprints
while it lives; one on CPU devices, which may share a NumPy array's memory, keeps none."""

from __future__ import annotations

import gc
import json

import checkpointables as cp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpointables_pytree import reuse

from .helpers import linked_names

pytestmark = pytest.mark.fast_path

on_accelerators = pytest.mark.skipif(
    jax.default_backend() == "cpu",
    reason="fingerprints are kept for arrays on accelerators only (CPU arrays may alias NumPy's)",
)


def _recorded_prints(checkpoint) -> dict[str, list[str]]:
    record = json.loads((checkpoint / "pytree" / reuse.RECORD_FILE).read_text())
    return {name: [p for _, p in e["shards"]] for name, e in record["arrays"].items()}


@on_accelerators
def test_a_saved_array_keeps_its_prints_and_links_with_them(tmp_path) -> None:
    rng = np.random.default_rng(0)
    frozen = {f"w{i}": jnp.asarray(rng.standard_normal((128, 256), np.float32)) for i in range(3)}
    host = rng.standard_normal((128, 256)).astype(np.float32)
    cp.save_pytree(tmp_path / "1", {"frozen": frozen, "host": host})
    cp.save_pytree(tmp_path / "2", {"frozen": frozen, "host": host}, reuse_from=tmp_path / "1")
    recorded = _recorded_prints(tmp_path / "2")
    for name, array in frozen.items():
        assert reuse.kept_prints(array) == recorded[f"frozen.{name}"]
    assert reuse.kept_prints(jnp.array(frozen["w0"], copy=True)) is None  # Another object.
    assert reuse.kept_prints(host) is None  # NumPy arrays can change in place.
    # The kept prints are what the next save compares: every array links.
    cp.save_pytree(tmp_path / "3", {"frozen": frozen, "host": host}, reuse_from=tmp_path / "2")
    assert len(linked_names(tmp_path / "3")) == 4
    loaded = cp.load_pytree(tmp_path / "3")
    assert all(np.array_equal(loaded["frozen"][k], v) for k, v in frozen.items())


def test_a_changed_value_in_a_new_array_is_written(tmp_path) -> None:
    w = jnp.arange(64 * 1024, dtype=jnp.float32)
    cp.save_pytree(tmp_path / "1", {"w": w})
    cp.save_pytree(tmp_path / "2", {"w": w}, reuse_from=tmp_path / "1")
    changed = w.at[7].add(1.0)  # A new object: fingerprinted, not taken from w's.
    cp.save_pytree(tmp_path / "3", {"w": changed}, reuse_from=tmp_path / "2")
    assert len(linked_names(tmp_path / "3")) == 0
    assert np.array_equal(cp.load_pytree(tmp_path / "3")["w"], changed)


@on_accelerators
def test_prints_go_with_their_array(tmp_path) -> None:
    arrays = {f"a{i}": jnp.full((64, 1024), float(i)) for i in range(4)}
    cp.save_pytree(tmp_path / "1", arrays)
    cp.save_pytree(tmp_path / "2", arrays, reuse_from=tmp_path / "1")
    before = reuse.kept_count()
    deleted = arrays.pop("a0")
    deleted.delete()  # Deleted (as a donated array is): its data is gone.
    assert reuse.kept_prints(deleted) is None
    del deleted
    arrays.clear()
    gc.collect()
    assert reuse.kept_count() <= before - 4  # (Others of earlier tests may go too.)


def test_an_array_on_cpu_sharing_numpy_memory_is_looked_at_every_save(tmp_path) -> None:
    # On CPU devices device_put does not copy: writing the NumPy array in place changes the
    # jax.Array. Its fingerprints are not kept, so a change anywhere in it is written.
    raw = np.zeros(256 * 256 * 4 + 128, np.uint8)  # Aligned, as zero-copy needs.
    start = -raw.ctypes.data % 128
    host = raw[start : start + 256 * 256 * 4].view(np.float32).reshape(256, 256)
    host[:] = 1.0
    shared = jax.device_put(host, jax.devices("cpu")[0])
    host[0, 0] = 2.0
    if float(shared[0, 0]) != 2.0:
        pytest.skip("this jax copies in device_put: nothing is shared")
    cp.save_pytree(tmp_path / "1", {"w": shared})
    cp.save_pytree(tmp_path / "2", {"w": shared}, reuse_from=tmp_path / "1")
    assert linked_names(tmp_path / "2") == {"w"} and reuse.kept_prints(shared) is None
    for index in [(0, 0), (200, 77)]:  # Where the probes look, and where they do not.
        host[index] += 5.0
        before = sorted(p.name for p in tmp_path.iterdir())[-1]
        after = tmp_path / f"{before}x"
        cp.save_pytree(after, {"w": shared}, reuse_from=tmp_path / before)
        assert not linked_names(after)
        assert np.array_equal(cp.load_pytree(after)["w"], host)
