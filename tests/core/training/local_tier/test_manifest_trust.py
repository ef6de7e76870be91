"""What a local tier trusts in a manifest: nothing but the one form a save writes, whole
(its own checksum), of this run. A damaged, forged or foreign manifest makes its copy
unused, never removes anything outside that copy, and never hides a newer valid step; a
copy that passes its checksums but fails to load is passed over for the next one."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import zlib
from pathlib import Path

import checkpointables as cp
import jax.numpy as jnp
import numpy as np
import pytest
from checkpointables.training.local_tier import _manifest, _restore, _transport
from checkpointables.training.local_tier._store import Store
from hypothesis import given, settings
from hypothesis import strategies as st

from .test_local_tier import checkpointer, run

EveryN = cp.training.save_decision_policies.EveryNStepsPolicy


def sealed(fields: dict) -> str:
    """``fields`` as a manifest's JSON with a correct checksum: only the fields are wrong."""
    body = json.dumps(fields, separators=(",", ":"), sort_keys=True)[:-1]
    return f'{body},"checksum":"{zlib.crc32(body.encode()):08x}"}}'


def saved_run(tmp_path) -> Path:
    """Local steps 10 and 20 (keep=3), nothing persistent: their local directory."""
    with checkpointer(tmp_path, persistent=1000, local=10, keep=3) as ckptr:
        run(ckptr, range(10, 21))
    return tmp_path / "local"


def _w(restored) -> float:
    return float(np.asarray(restored["w"])[0, 0])


def test_a_bit_flipped_in_an_older_manifest_never_brings_back_the_older_step(
    tmp_path, caplog
) -> None:
    local = saved_run(tmp_path)
    path = local / "10" / "p0-of-1.manifest.json"
    text = path.read_text()
    stamp = str(json.loads(text[: text.rindex(',"checksum"')] + "}")["commit_timestamp_nsecs"])
    flipped = chr(ord(stamp[0]) ^ 8) + stamp[1:]  # One bit: the copy now looks newest.
    path.write_text(text.replace(f":{stamp},", f":{flipped},"))
    with checkpointer(tmp_path, persistent=1000, local=10, keep=3) as ckptr:
        assert ckptr.latest_step().step == 20
        assert _w(ckptr.load_pytree()) == 20 and ckptr.last_restore_stats.step == 20
        assert [s.step for s in ckptr.steps(tier="local")] == [20]
        ckptr.save_pytree(30, {"w": jnp.zeros((3, 4)), "b": np.zeros(5, np.int32), "step": 30})
        assert [s.step for s in ckptr.steps(tier="local")] == [20, 30]
    assert "does not match its checksum" in caplog.text


@pytest.mark.parametrize("writer", [".", "..", "p0-of-1/..", "p1-of-1", "p0-of-0"])
@pytest.mark.parametrize("with_checksum", [False, True])
def test_a_forged_manifest_in_a_step_is_passed_over(tmp_path, caplog, writer, with_checksum):
    local = saved_run(tmp_path)
    fields = json.loads(Path(local / "20" / "p0-of-1.manifest.json").read_text())
    del fields["checksum"]
    fields.update(writer=writer, files={})
    if writer == "p0-of-0":
        fields.update(process_count=0)
    text = sealed(fields) if with_checksum else json.dumps(fields)
    name = writer.replace("/", "") + ".manifest.json"
    (local / "20" / name).write_text(text)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with checkpointer(tmp_path, persistent=1000, local=10, keep=3) as ckptr:
        assert _w(ckptr.load_pytree()) == 20 and ckptr.last_restore_stats.tier == "local"
    after = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert set(before) <= set(after)
    assert "passing over a copy" in caplog.text


def test_a_copy_that_passes_its_checksums_but_is_no_checkpoint_is_passed_over(
    tmp_path, caplog
) -> None:
    local = saved_run(tmp_path)
    copy = local / "20" / "p0-of-1"
    old = _manifest.read(str(local / "20" / "p0-of-1.manifest.json"))
    os.remove(copy / "_CHECKPOINT_METADATA")
    fields = {k: getattr(old, k) for k in ("process_index", "process_count", "held", "shards")}
    rebuilt = _manifest.build(str(copy), 20, "p0-of-1", run=old.run, **fields)
    Store(str(local), old.run).commit_copy(rebuilt)  # Its checksums hold what is there.
    with checkpointer(tmp_path, persistent=1000, local=10, keep=3) as ckptr:
        assert _w(ckptr.load_pytree()) == 10 and ckptr.last_restore_stats.step == 10
    assert "step 20 failed to load" in caplog.text


def test_another_runs_step_copied_in_is_passed_over(tmp_path, caplog) -> None:
    local = saved_run(tmp_path / "b")
    with checkpointer(tmp_path / "a", persistent=1000, local=10) as other:
        other.save_pytree(30, {"w": jnp.full((3, 4), -1.0), "b": np.zeros(5, np.int32)})
    shutil.copytree(tmp_path / "a" / "local" / "30", local / "30")
    with checkpointer(tmp_path / "b", persistent=1000, local=10, keep=3) as ckptr:
        assert _w(ckptr.load_pytree()) == 20 and ckptr.last_restore_stats.step == 20
        assert [s.step for s in ckptr.steps(tier="local")] == [10, 20]
    assert "a copy of the run of" in caplog.text and str(tmp_path / "a") in caplog.text
    # A run moved to a new root (its record removed, as the guide says) keeps its steps.
    shutil.rmtree(local / "30")
    os.remove(local / ".checkpointables-local-tier.json")
    tier = cp.training.LocalTier(local, save_decision_policy=EveryN(10), keep=3)
    with cp.training.Checkpointer(tmp_path / "moved", local_tier=tier) as moved:
        assert _w(moved.load_pytree()) == 20 and moved.last_restore_stats.tier == "local"


# -- Any manifest a peer may report ------------------------------------------------------

_NAMES = st.one_of(
    st.sampled_from(["..", "../x", "/etc/passwd", "a/../../b", ".", "a//b", "a\\b", "", "ok"]),
    st.text(alphabet="./ab", max_size=8),
)
_WRITERS = st.one_of(
    st.sampled_from([".", "..", "...", "p0-of-1", "p1-of-2", "p0-of-0", "p-1-of-2", "../p0-of-1"]),
    st.text(alphabet="./p0-of1", max_size=10),
)


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    """A peer's store with a valid copy of step 7 (writer p0-of-1), served over HTTP."""
    source = Store(str(tmp_path_factory.mktemp("peer")), "run")
    copy = source.copy_dir(7, "p0-of-1")
    cp.save_pytree(copy, {"w": jnp.arange(8.0)})
    fields = {"process_index": 0, "process_count": 1, "held": {}, "shards": {}, "run": "run"}
    source.commit_copy(_manifest.build(copy, 7, "p0-of-1", **fields))
    server = _transport.FileServer(source.directory, "127.0.0.1")
    yield source, server
    server.close()


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@settings(max_examples=30, deadline=None)
@given(
    writer=_WRITERS,
    index=st.integers(-1, 3),
    count=st.integers(-1, 3),
    files=st.dictionaries(_NAMES, st.tuples(st.integers(-1, 9), st.integers(0, 9)), max_size=3),
)
def test_no_reported_manifest_removes_anything_outside_its_copy(
    peer, tmp_path_factory, writer, index, count, files
) -> None:
    source, server = peer
    root = tmp_path_factory.mktemp("host")
    (root / "outside.txt").write_text("keep")
    me = Store(str(root / "local"), "run")
    os.makedirs(me.step_dir(7))
    (Path(me.step_dir(7)) / "keep.txt").write_text("keep")
    before = _tree(root)
    valid = source.copies(7)["p0-of-1"]
    fields = json.loads(valid.to_json())
    del fields["checksum"]
    fields.update(writer=writer, process_index=index, process_count=count)
    fields.update(files={k: list(v) for k, v in files.items()})
    forged = sealed(fields)
    # Process 1 (the peer) reports the forged manifest under its writer name, and the valid one.
    reported = _restore._valid(1, "7", {writer: forged, "p0-of-1": valid.to_json()})
    inventory = _restore.Inventory({0: "", 1: server.address}, {1: {7: reported}})
    try:
        _manifest.Manifest.from_json(forged)
    except _manifest.InvalidManifest:
        assert reported == {"p0-of-1": valid}  # Passed over, the valid copy still there.
        assert inventory.complete_steps() == [7]
    for option in _restore.options(inventory.holders(7), 0, 1, None):
        with contextlib.suppress(_transport.FetchError):
            _restore.obtain(me, inventory, [option], 0, timeout=5)
    after = _tree(root)
    assert {k: v for k, v in after.items() if k in before} == before  # Nothing lost.
    new = set(after) - set(before)
    assert all(k.startswith("local/7/p") for k in new), new  # Only copies of step 7.
    assert set(me.copies(7)) <= {"p0-of-1", writer}
