"""Arrays on CPU devices whose probes show a change are written without a fingerprint.

A probe (``reuse.probe``) hashes a few windows of an array's bytes. Probes that
differ from the source's record prove the array changed: it is written and
recorded without a fingerprint. When a later save finds equal probes against
such a record, it compares the array's bytes with the source's chunk itself.
Either way a changed array must never be linked, and an unchanged one must be.
"""

from __future__ import annotations

import json
import shutil

import checkpointables as cp
import jax.numpy as jnp
import numpy as np
import pytest
from checkpointables_pytree import reuse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ....python_subprocess import assert_verifies
from .helpers import linked_names

pytestmark = pytest.mark.fast_path


def _record(checkpoint) -> dict:
    return json.loads((checkpoint / "pytree" / reuse.RECORD_FILE).read_text())["arrays"]


def _prints(checkpoint, name: str) -> list[str | None]:
    return [p for _, p in _record(checkpoint)[name]["shards"]]


def _tree(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {f"w{i}": jnp.asarray(rng.standard_normal((64, 512), np.float32)) for i in range(3)}


def _fresh(tree: dict) -> dict:
    """Equal arrays in new objects: probed again, not taken from kept fingerprints."""
    return {name: jnp.asarray(np.array(a)) for name, a in tree.items()}


def _host_print(array) -> str:
    return reuse.fingerprint_numpy([np.asarray(array)])[0]


def _with_a_changed_step(tmp_path, tree: dict, changed_name: str) -> dict:
    """Steps 0 (plain), 1 (fingerprints and probes) and 2 (``changed_name`` changed
    everywhere: no fingerprint); returns step 2's tree."""
    cp.save_pytree(tmp_path / "0", tree)
    cp.save_pytree(tmp_path / "1", _fresh(tree), reuse_from=tmp_path / "0")
    changed = dict(_fresh(tree), **{changed_name: tree[changed_name] * 2 + 1})
    cp.save_pytree(tmp_path / "2", changed, reuse_from=tmp_path / "1")
    return changed


def test_a_changed_array_is_written_without_a_fingerprint(tmp_path) -> None:
    tree = _tree(0)
    changed = _with_a_changed_step(tmp_path, tree, "w1")
    assert _prints(tmp_path / "1", "w1") == [_host_print(tree["w1"])]
    assert _prints(tmp_path / "2", "w1") == [None]
    raw = reuse.host_bytes(np.asarray(changed["w1"]))
    assert _record(tmp_path / "2")["w1"]["probes"] == [reuse.probe(raw)]
    assert linked_names(tmp_path / "2") == {"w0", "w2"}
    loaded = cp.load_pytree(tmp_path / "2")
    assert all(np.array_equal(loaded[k], v) for k, v in changed.items())


def test_an_array_unchanged_after_its_change_links_by_its_bytes(tmp_path) -> None:
    # An EMA: changed at step 2, the same at step 3. Step 2 recorded no fingerprint,
    # so step 3 compares the bytes, links them, and records the fingerprint for step 4.
    changed = _with_a_changed_step(tmp_path, _tree(1), "w1")
    cp.save_pytree(tmp_path / "3", _fresh(changed), reuse_from=tmp_path / "2")
    assert linked_names(tmp_path / "3") == {"w0", "w1", "w2"}
    assert _prints(tmp_path / "3", "w1") == [_host_print(changed["w1"])]
    cp.save_pytree(tmp_path / "4", _fresh(changed), reuse_from=tmp_path / "3")
    assert linked_names(tmp_path / "4") == {"w0", "w1", "w2"}
    shutil.rmtree(tmp_path / "2")
    shutil.rmtree(tmp_path / "3")
    loaded = cp.load_pytree(tmp_path / "4")
    assert all(np.array_equal(loaded[k], v) for k, v in changed.items())
    assert_verifies(tmp_path / "4")


_SETTINGS = settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_SETTINGS
@given(size=st.integers(16 * 1024, 40 * 1024), data=st.data())
def test_a_single_bit_changed_after_an_unprinted_step_is_never_linked(
    tmp_path_factory, size, data
) -> None:
    root = tmp_path_factory.mktemp("probes")
    values = np.random.default_rng(size).standard_normal(size).astype(np.float32)
    _with_a_changed_step(root, {"w": jnp.asarray(values)}, "w")
    now = np.asarray(jnp.asarray(values) * 2 + 1)  # What step 2 holds.
    changed = now.copy()
    index = data.draw(st.integers(0, size - 1))
    changed.view(np.uint32)[index] ^= np.uint32(1 << data.draw(st.integers(0, 31)))
    cp.save_pytree(root / "3", {"w": jnp.asarray(changed)}, reuse_from=root / "2")
    assert linked_names(root / "3") == set()
    assert np.asarray(cp.load_pytree(root / "3")["w"]).tobytes() == changed.tobytes()


def test_a_damaged_source_chunk_is_written_afresh(tmp_path) -> None:
    # Equal probes against a record without fingerprints: the bytes decide, and the
    # source's chunk no longer holds them (damaged on disk, its size unchanged).
    changed = _with_a_changed_step(tmp_path, _tree(2), "w1")
    data = tmp_path / "2" / "pytree" / "d"
    owned = [f for f in data.iterdir() if f.stat().st_nlink == 1]
    sizes = {f: f.stat().st_size for f in owned}
    target = max(owned, key=lambda f: sizes[f])  # w1's file: 128 KiB and its end.
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    target.write_bytes(bytes(raw))
    cp.save_pytree(tmp_path / "3", _fresh(changed), reuse_from=tmp_path / "2")
    assert linked_names(tmp_path / "3") == {"w0", "w2"}
    loaded = cp.load_pytree(tmp_path / "3")
    assert all(np.array_equal(loaded[k], v) for k, v in changed.items())
    assert_verifies(tmp_path / "3")


def test_compressed_saves_keep_every_fingerprint(tmp_path) -> None:
    # A compressed chunk is not the array's bytes: no comparison could stand in.
    with cp.Context(array_options=cp.options.ArrayOptions(use_compression=True)):
        _with_a_changed_step(tmp_path, _tree(3), "w1")
    assert None not in _prints(tmp_path / "2", "w1")
    assert "probes" not in _record(tmp_path / "2")["w1"]


def test_numpy_arrays_keep_every_fingerprint(tmp_path) -> None:
    # NumPy arrays are not probed: only jax.Arrays on CPU devices, whose bytes never change.
    host = {"h": np.arange(1 << 16, dtype=np.float32)}
    cp.save_pytree(tmp_path / "0", host)
    cp.save_pytree(tmp_path / "1", host, reuse_from=tmp_path / "0")
    cp.save_pytree(tmp_path / "2", {"h": host["h"] + 1}, reuse_from=tmp_path / "1")
    assert _prints(tmp_path / "2", "h") == [_host_print(host["h"] + 1)]


@given(values=st.binary(min_size=1, max_size=1 << 14), data=st.data())
@settings(max_examples=60, deadline=None)
def test_probes_are_of_the_bytes_and_see_both_ends(values, data) -> None:
    raw = np.frombuffer(values, np.uint8)
    probe = reuse.probe(raw)
    assert probe.startswith(reuse.PROBE_KIND) and probe == reuse.probe(raw.copy())
    changed = raw.copy()
    changed[data.draw(st.sampled_from([0, raw.size - 1]))] ^= 1 << data.draw(st.integers(0, 7))
    assert reuse.probe(changed) != probe
