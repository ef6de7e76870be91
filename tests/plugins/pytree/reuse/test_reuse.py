"""Incremental saves (``reuse_from=``, ``Checkpointer(reuse_unchanged=...)``) on real files.

Every step must be complete on its own: it loads bit-exact, passes ``verify``
and stays whole when any other step is deleted; a changed array is never
linked; linked files are hard links of the source's.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import checkpointables as cp
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpointables_pytree import reuse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ....python_subprocess import assert_verifies
from .helpers import assert_same, linked_names

# Linking is the fast path's (our own database writer's): CI's run with it off keeps it on
# here, and one test below turns it off itself.
pytestmark = pytest.mark.fast_path

KiB = 1 << 10


def _tree(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "base": {
            f"w{i}": jnp.asarray(rng.standard_normal((64, 512), dtype=np.float32)) for i in range(4)
        },
        "bf16": jnp.asarray(rng.standard_normal((256, 256)), dtype=jnp.bfloat16),
        "host": rng.integers(0, 1 << 30, size=(40_000,), dtype=np.int32),
        "adapter": jnp.asarray(rng.standard_normal((128, 256), dtype=np.float32)),
        "count": jnp.array(3, jnp.int32),
        "step": 7,
    }


def _linked_files(checkpoint) -> set[str]:
    """Names of the data files of ``checkpoint`` that are hard links (shared)."""
    found = set()
    for directory, _, names in os.walk(checkpoint):
        for name in names:
            if os.stat(os.path.join(directory, name)).st_nlink > 1:
                found.add(name)
    return found


def test_reuse_from_links_unchanged_arrays_and_survives_the_source(tmp_path) -> None:
    tree = _tree()
    cp.save_pytree(tmp_path / "1", tree)
    cp.save_pytree(tmp_path / "2", tree, reuse_from=tmp_path / "1")  # records fingerprints
    changed = dict(tree, adapter=tree["adapter"] + 1, host=tree["host"] + 1)
    cp.save_pytree(tmp_path / "3", changed, reuse_from=tmp_path / "2")
    assert linked_names(tmp_path / "3") == {f"base.w{i}" for i in range(4)} | {"bf16"}
    assert _linked_files(tmp_path / "3")
    shutil.rmtree(tmp_path / "2")
    shutil.rmtree(tmp_path / "1")
    assert_same(cp.load_pytree(tmp_path / "3"), changed)
    assert_verifies(tmp_path / "3")
    assert _linked_files(tmp_path / "3") == set()  # Sole owner of its files now.


def test_with_the_fast_path_off_every_array_is_written(tmp_path) -> None:
    tree = _tree()
    cp.save_pytree(tmp_path / "1", tree)
    cp.save_pytree(tmp_path / "2", tree, reuse_from=tmp_path / "1")
    off = cp.options.ArrayOptions(ocdbt_fast_path=False)
    with cp.Context(array_options=off):
        cp.save_pytree(tmp_path / "3", tree, reuse_from=tmp_path / "2")
    assert _linked_files(tmp_path / "3") == set()
    shutil.rmtree(tmp_path / "2")
    assert_same(cp.load_pytree(tmp_path / "3"), tree)
    assert_verifies(tmp_path / "3")


def test_a_record_of_an_earlier_fingerprint_kind_links_nothing(tmp_path) -> None:
    # Earlier versions hashed host data with BLAKE3 ("b") and SHA-256 ("s"): the same
    # digits under another kind letter must not count as a match.
    tree = _tree()
    cp.save_pytree(tmp_path / "1", tree)
    cp.save_pytree(tmp_path / "2", tree, reuse_from=tmp_path / "1")  # Records its prints.
    record = tmp_path / "2" / "pytree" / reuse.RECORD_FILE
    text = record.read_text()
    assert text.count('"x') == 7  # XXH3 prints of the host-resident (here: CPU) arrays.
    record.write_text(text.replace('"x', '"b'))
    cp.save_pytree(tmp_path / "3", tree, reuse_from=tmp_path / "2")
    assert _linked_files(tmp_path / "3") == set()
    cp.save_pytree(tmp_path / "4", tree, reuse_from=tmp_path / "3")  # Its own prints match.
    assert len(_linked_files(tmp_path / "4")) == 7
    assert_same(cp.load_pytree(tmp_path / "4"), tree)


def test_a_source_saved_without_reuse_says_what_the_save_does(tmp_path, caplog) -> None:
    # No record: only arrays on CPU devices are compared with what it stores; the log says
    # so, naming the source and the name. (Sources of other names: test_source_choice.)
    tree = _tree()
    cp.save_pytree(tmp_path / "1", tree)
    with caplog.at_level(logging.INFO, logger="checkpointables.reuse"):
        cp.save_pytree(tmp_path / "2", tree, reuse_from=tmp_path / "1")
    said = [r.getMessage() for r in caplog.records if r.name == "checkpointables.reuse"]
    assert any(f"reuse_from={tmp_path / '1'}: its 'pytree' has no record" in m for m in said)
    assert len(linked_names(tmp_path / "2")) == 6  # All but the NumPy array: compared.
    cp.save_checkpointables(tmp_path / "3", {"state": tree}, reuse_from=tmp_path / "2")
    assert len(linked_names(tmp_path / "3", "state")) == 7  # Recorded: every array.


def test_inspect_shows_each_array_written_or_reused(tmp_path) -> None:
    tree = _tree()
    cp.save_pytree(tmp_path / "1", tree, reuse_from=None)
    cp.save_pytree(tmp_path / "2", tree, reuse_from=tmp_path / "1")
    changed = dict(tree, adapter=tree["adapter"] + 1)
    cp.save_pytree(tmp_path / "3", changed, reuse_from=tmp_path / "2")
    done = subprocess.run(
        [sys.executable, "-m", "checkpointables", "inspect", str(tmp_path / "3")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "    adapter: written" in done.stdout, done.stdout
    assert "    base.w0: reused from 2" in done.stdout, done.stdout
    assert "    host: reused from 2" in done.stdout, done.stdout


def test_inspect_quotes_control_characters_of_a_forged_record(tmp_path) -> None:
    tree = _tree()
    cp.save_pytree(tmp_path / "1", tree, reuse_from=None)
    cp.save_pytree(tmp_path / "2", tree, reuse_from=tmp_path / "1")
    record_file = tmp_path / "2" / "pytree" / reuse.RECORD_FILE
    record = json.loads(record_file.read_text())
    forged = {"signature": "s", "shards": [], "reused_from": "\x1b]0;owned\x07"}
    record["arrays"]["evil\x1b[2J"] = forged
    record_file.write_text(json.dumps(record))
    done = subprocess.run(
        [sys.executable, "-m", "checkpointables", "inspect", str(tmp_path / "2")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout
    assert "    'evil\\x1b[2J': reused from '\\x1b]0;owned\\x07'" in done.stdout, done.stdout
    assert "    base.w0: reused from 1" in done.stdout, done.stdout


@pytest.mark.parametrize("sharded_changes", [True, False])
def test_sharded_and_single_device_leaves_link_and_load(tmp_path, mesh_4x2, sharded_changes):
    # A linked sharded array leaves the leaf group to the per-array path; linked single-device
    # arrays beside a written sharded one go through the group's (standing in for their data).
    rng = np.random.default_rng(3)
    sharding = jax.sharding.NamedSharding(mesh_4x2, jax.sharding.PartitionSpec("x", "y"))
    tree = {
        "single": jnp.asarray(rng.standard_normal((128, 256), np.float32)),
        "sharded": jax.device_put(rng.standard_normal((512, 512)).astype(np.float32), sharding),
        "moved": jnp.asarray(rng.standard_normal((128, 256), np.float32)),
    }
    cp.save_pytree(tmp_path / "1", tree, reuse_from=None)
    cp.save_pytree(tmp_path / "2", tree, reuse_from=tmp_path / "1")
    changed = dict(tree, moved=tree["moved"] + 1)
    changed["sharded" if sharded_changes else "single"] = (
        tree["sharded"] * 2 + 1 if sharded_changes else tree["single"] - 1
    )
    assert len(changed["sharded"].sharding.device_set) == 8
    cp.save_pytree(tmp_path / "3", changed, reuse_from=tmp_path / "2")
    (pytree,) = [p for p in (tmp_path / "3").iterdir() if (p / reuse.RECORD_FILE).exists()]
    kept = "single" if sharded_changes else "sharded"
    assert reuse.reuse_report(pytree) == {
        kept: "2",
        "moved": None,
        ("sharded" if sharded_changes else "single"): None,
    }
    shutil.rmtree(tmp_path / "2")
    shutil.rmtree(tmp_path / "1")
    loaded = cp.load_pytree(tmp_path / "3")
    assert_same(loaded, changed)
    assert_verifies(tmp_path / "3")


def test_prng_keys_and_small_leaves_are_written(tmp_path) -> None:
    tree = {"keys": jax.random.split(jax.random.key(0), 8192), "tiny": np.ones(3)}
    tree["big"] = np.arange(reuse.MIN_BYTES, dtype=np.uint8)
    cp.save_pytree(tmp_path / "1", tree, reuse_from=None)
    cp.save_pytree(tmp_path / "2", tree, reuse_from=tmp_path / "1")
    shutil.rmtree(tmp_path / "1")
    loaded = cp.load_pytree(tmp_path / "2")
    assert (jax.random.key_data(loaded["keys"]) == jax.random.key_data(tree["keys"])).all()
    assert np.asarray(loaded["big"]).tobytes() == tree["big"].tobytes()


def test_a_dtype_without_fingerprints_is_written_and_said_once(tmp_path, caplog) -> None:
    # A 4-bit frozen base (QLoRA): written at every save; the log named only the predicate.
    tree = {"base": {"q": jnp.ones((512, 512), jnp.int4)}, "adapter": jnp.ones((128, 256))}
    frozen = cp.training.Checkpointer(tmp_path, reuse_unchanged=lambda n: n.startswith("base."))
    with caplog.at_level(logging.INFO, logger="checkpointables.reuse"), frozen:
        frozen.save_pytree(1, tree, force=True)
        frozen.save_pytree(2, tree, force=True)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("of dtype int4" in m and "'base.q'" in m for m in said), said
    assert linked_names(tmp_path / "2") == set()
    assert (np.asarray(cp.load_pytree(tmp_path / "2")["base"]["q"]) == 1).all()


def test_async_forms_and_save_checkpointables(tmp_path) -> None:
    tree = _tree()
    cp.save_checkpointables(tmp_path / "1", {"state": tree, "cfg": {"lr": 0.1}})
    cp.save_checkpointables_async(
        tmp_path / "2", {"state": tree, "cfg": {"lr": 0.1}}, reuse_from=tmp_path / "1"
    ).result()
    cp.save_pytree_async(tmp_path / "3", tree, reuse_from=tmp_path / "2").result()
    # No "pytree" in step 2: its only pytree, "state", stands in (its "cfg" is JSON).
    assert len(linked_names(tmp_path / "3")) == 7
    cp.save_checkpointables(tmp_path / "4", {"state": tree}, reuse_from=tmp_path / "2")
    assert len(linked_names(tmp_path / "4", "state")) == 7
    shutil.rmtree(tmp_path / "2")
    assert_same(cp.load_checkpointables(tmp_path / "4")["state"], tree)


def test_reuse_from_must_be_a_committed_checkpoint(tmp_path) -> None:
    tree = {"a": np.zeros(3)}
    with pytest.raises(cp.errors.CheckpointNotFoundError, match="reuse_from=.*missing"):
        cp.save_pytree(tmp_path / "1", tree, reuse_from=tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(cp.errors.NotACheckpointError, match="reuse_from"):
        cp.save_pytree(tmp_path / "1", tree, reuse_from=tmp_path / "empty")
    assert not (tmp_path / "1").exists()


def test_a_missing_step_of_a_run_names_the_steps_there(tmp_path) -> None:
    cp.save_pytree(tmp_path / "ckpt" / "98", {"a": np.zeros(3)})
    with pytest.raises(cp.errors.CheckpointNotFoundError) as raised:
        cp.save_pytree(tmp_path / "p", {"a": np.zeros(3)}, reuse_from=tmp_path / "ckpt" / "99")
    assert isinstance(raised.value, FileNotFoundError)  # Its builtin meaning, kept.
    assert f"reuse_from={tmp_path / 'ckpt' / '99'} does not exist" in str(raised.value)
    assert f"e.g. reuse_from={tmp_path / 'ckpt' / '98'}" in str(raised.value)
    assert not (tmp_path / "p").exists()


def test_a_short_source_file_is_written_afresh(tmp_path) -> None:
    tree = _tree()
    cp.save_pytree(tmp_path / "1", _tree(seed=1), reuse_from=None)
    # Every array changed: written, each in a file of its own, and recorded.
    cp.save_pytree(tmp_path / "2", tree, reuse_from=tmp_path / "1")
    assert _linked_files(tmp_path / "2") == set()
    # Damage: every array's data file of step 2 loses its last byte (a torn copy).
    data = tmp_path / "2" / "pytree" / "d"
    for f in data.iterdir():
        if f.stat().st_size > reuse.MIN_BYTES:
            os.truncate(f, f.stat().st_size - 1)
    cp.save_pytree(tmp_path / "3", tree, reuse_from=tmp_path / "2")
    assert _linked_files(tmp_path / "3") == set()
    assert_same(cp.load_pytree(tmp_path / "3"), tree)


def _checkpointer(root, keep=None, **kwargs):
    keep = keep or cp.training.preservation_policies.PreserveAll()
    kwargs.setdefault("reuse_unchanged", True)
    return cp.training.Checkpointer(
        root,
        preservation_policy=keep,
        save_decision_policy=cp.training.save_decision_policies.EveryNStepsPolicy(1),
        **kwargs,
    )


def test_checkpointer_reuses_across_steps_and_counts_bytes(tmp_path) -> None:
    tree = _tree()
    base_bytes = sum(int(a.nbytes) for a in tree["base"].values()) + tree["bf16"].nbytes
    trees = {}
    with _checkpointer(tmp_path, cp.training.preservation_policies.LatestN(2)) as ckptr:
        for step in range(5):
            tree = dict(tree, adapter=tree["adapter"] * 1.5, count=tree["count"] + 1)
            if step == 3:  # An array that changes rarely (an EMA).
                tree["host"] = tree["host"] + 1
            ckptr.save_pytree(step, tree)
            trees[step] = tree
            stats = ckptr.last_save_stats
            assert stats.as_dict()["checkpoint/bytes_reused"] == stats.bytes_reused
            if step == 0:
                assert stats.bytes_reused == 0
            elif step == 3:
                assert stats.bytes_reused == base_bytes
            else:
                assert stats.bytes_reused == base_bytes + tree["host"].nbytes
    assert [s.step for s in cp.training.Checkpointer(tmp_path).steps()] == [3, 4]
    for step in (3, 4):
        assert_same(cp.load_pytree(tmp_path / str(step)), trees[step])
        assert_verifies(tmp_path / str(step))


def test_the_default_reuses_on_local_storage_on_cpu_too(tmp_path) -> None:
    tree = _tree()
    decide = cp.training.save_decision_policies.EveryNStepsPolicy(1)
    with cp.training.Checkpointer(tmp_path, save_decision_policy=decide) as ckptr:
        ckptr.save_pytree(0, tree)
        ckptr.save_pytree(1, tree)
        assert ckptr.last_save_stats.bytes_reused > 0


def test_checkpointer_reuse_can_be_turned_off(tmp_path) -> None:
    tree = _tree()
    with _checkpointer(tmp_path, reuse_unchanged=False) as ckptr:
        ckptr.save_pytree(0, tree)
        ckptr.save_pytree(1, tree)
        assert ckptr.last_save_stats.bytes_reused == 0
    assert _linked_files(tmp_path / "1") == set()


def test_frozen_predicate_skips_fingerprints(tmp_path) -> None:
    tree = _tree()
    frozen = lambda name: name.startswith("base.")  # noqa: E731
    with _checkpointer(tmp_path, reuse_unchanged=frozen) as ckptr:
        ckptr.save_pytree(0, tree)
        ckptr.save_pytree(1, dict(tree, adapter=tree["adapter"] + 1))
        base_bytes = sum(int(a.nbytes) for a in tree["base"].values())
        assert ckptr.last_save_stats.bytes_reused >= base_bytes


def test_arrays_declared_frozen_share_data_files_and_stay_whole(tmp_path) -> None:
    # Always linked together, the frozen arrays share a data file: the next save makes one
    # link, not one per array; and a step stays whole when the one it linked from goes.
    rng = np.random.default_rng(3)
    base = {f"w{i}": jnp.asarray(rng.standard_normal((64, 512), np.float32)) for i in range(8)}
    tree = {"base": base, "adapter": jnp.asarray(rng.standard_normal((128, 256), np.float32))}
    frozen = lambda name: name.startswith("base.")  # noqa: E731
    with _checkpointer(tmp_path, reuse_unchanged=frozen) as ckptr:
        ckptr.save_pytree(0, tree)
        # A frozen array of another shape is written; the others of its file still link.
        changed = {
            "base": dict(base, w3=base["w3"].reshape(128, 256)),
            "adapter": tree["adapter"] + 1,
        }
        ckptr.save_pytree(1, changed)
        assert ckptr.last_save_stats.bytes_reused == 7 * 128 * KiB
    assert len(_linked_files(tmp_path / "1")) == 1
    shutil.rmtree(tmp_path / "0")
    assert_same(cp.load_pytree(tmp_path / "1"), changed)
    assert_verifies(tmp_path / "1")


def _data_files(checkpoint) -> list[str]:
    """The names of the files in ``checkpoint``'s data directories (``d/``): data files,
    linked or written, and the b-tree's."""
    return [
        name
        for directory, _, names in os.walk(checkpoint)
        if os.path.basename(directory) == "d"
        for name in names
    ]


def _layers(count: int) -> dict:
    """A model's layers: a kernel to reuse and a bias (under ``reuse.MIN_BYTES``) each."""
    rng = np.random.default_rng(5)
    return {
        f"layer{i}": {
            "bias": jnp.full((512,), float(i), jnp.float32),
            "kernel": jnp.asarray(rng.standard_normal((64, 512), np.float32)),
        }
        for i in range(count)
    }


@pytest.mark.parametrize("declared", [False, True], ids=["fingerprinted", "declared-frozen"])
def test_small_arrays_start_no_data_file_of_their_own(tmp_path, declared) -> None:
    # Rewritten at every save, arrays under MIN_BYTES fill the file being written: 300 of
    # them cost no more files than in a plain save, and the biases between frozen kernels
    # do not split the kernels' shared files.
    small = {f"s{i:03d}": jnp.full((256,), float(i), jnp.float32) for i in range(300)}
    tree = {"adapter": jnp.zeros((128, 256), jnp.float32), "base": _layers(8), "small": small}
    with _checkpointer(tmp_path / "plain", reuse_unchanged=False) as ckptr:
        ckptr.save_pytree(0, tree)
    frozen = (lambda name: name.startswith("base.")) if declared else True
    changed = dict(tree, adapter=tree["adapter"] + 1)
    with _checkpointer(tmp_path / "run", reuse_unchanged=frozen) as ckptr:
        ckptr.save_pytree(0, tree)
        ckptr.save_pytree(1, changed)
        assert ckptr.last_save_stats.bytes_reused == 8 * 128 * KiB
    plain = len(_data_files(tmp_path / "plain" / "0"))
    # Fingerprinted: a file for each array to link (the adapter, 8 kernels); declared:
    # the adapter's, the frozen kernels' together. Each step also has its b-tree's file.
    files = 2 + 1 if declared else 9 + 1
    assert len(_data_files(tmp_path / "run" / "0")) == files <= plain + 8
    assert len(_linked_files(tmp_path / "run" / "1")) == (1 if declared else 8)
    shutil.rmtree(tmp_path / "run" / "0")
    assert_same(cp.load_pytree(tmp_path / "run" / "1"), changed)
    assert_verifies(tmp_path / "run" / "1")


@pytest.mark.parametrize("as_array", [jnp.asarray, np.asarray], ids=["probed", "fingerprinted"])
def test_arrays_changing_at_every_save_share_files_and_an_ema_keeps_its_own(
    tmp_path, as_array
) -> None:
    # Arrays that the source wrote too and that changed again (adapters, a full fine-tune)
    # share data files, as in a plain save; an array reused before and changed now (an
    # EMA) gets a file of its own, which the next save links whole. A change is shown by
    # the probes (arrays on CPU devices) or by the fingerprints (NumPy arrays).
    rng = np.random.default_rng(4)
    tree = {f"w{i}": as_array(rng.standard_normal((64, 512), np.float32)) for i in range(6)}
    tree["ema"] = as_array(rng.standard_normal((64, 512), np.float32))
    steps = [tree]
    for ema_changes in (False, True, False):
        trained = {k: v + 1 for k, v in steps[-1].items() if k != "ema"}
        ema = steps[-1]["ema"] * (0.5 if ema_changes else 1.0)
        steps.append({**trained, "ema": ema})
    with _checkpointer(tmp_path) as ckptr:
        for step, state in enumerate(steps):
            ckptr.save_pytree(step, state)
    # Each step also has its b-tree's file.
    assert len(_data_files(tmp_path / "0")) == 7 + 1  # No record to go by: a file each.
    # The EMA's file linked, the six changed weights written together.
    assert len(_data_files(tmp_path / "1")) == 2 + 1
    assert len(_data_files(tmp_path / "2")) == 2 + 1  # The weights, and the EMA alone.
    linked = _linked_files(tmp_path / "3")
    (ema_file,) = [p for p in (tmp_path / "3").rglob("*") if p.name in linked]  # One file,
    assert ema_file.stat().st_size < 2 * tree["ema"].nbytes  # the EMA's, not the weights'.
    for step in (0, 1, 2):
        shutil.rmtree(tmp_path / str(step))
    assert_same(cp.load_pytree(tmp_path / "3"), steps[3])
    assert_verifies(tmp_path / "3")


def test_retention_waits_for_a_save_reusing_the_step(tmp_path) -> None:
    """LatestN(1) deletes step 0 after step 1 commits: never while step 1 links from it."""
    tree = _tree()
    with _checkpointer(tmp_path, cp.training.preservation_policies.LatestN(1)) as ckptr:
        ckptr.save_pytree(0, tree)
        response = ckptr.save_pytree_async(1, dict(tree, adapter=tree["adapter"] + 1))
        assert (tmp_path / "0").exists()  # Leased while the save reuses it.
        assert response.result()
        ckptr.save_pytree(2, tree)
    assert [s.step for s in cp.training.Checkpointer(tmp_path).steps()] == [2]
    assert_same(cp.load_pytree(tmp_path / "2"), tree)
    assert_verifies(tmp_path / "2")


@pytest.mark.orbax
@pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring:UserWarning")
def test_orbax_loads_a_reusing_step(tmp_path) -> None:
    from orbax.checkpoint import v1 as ocp_v1

    tree = _tree()
    cp.save_pytree(tmp_path / "1", tree, reuse_from=None)
    cp.save_pytree(tmp_path / "2", tree, reuse_from=tmp_path / "1")
    cp.save_pytree(tmp_path / "3", tree, reuse_from=tmp_path / "2")
    assert _linked_files(tmp_path / "3")
    shutil.rmtree(tmp_path / "2")
    loaded = ocp_v1.load(tmp_path / "3")
    for key in ("adapter", "bf16", "host"):
        assert np.asarray(loaded[key]).tobytes() == np.asarray(tree[key]).tobytes()
    for key, value in tree["base"].items():
        assert np.asarray(loaded["base"][key]).tobytes() == np.asarray(value).tobytes()


def test_deleting_random_steps_in_random_order_keeps_the_rest(tmp_path) -> None:
    rng = random.Random(31)
    tree = _tree()
    trees = {}
    with _checkpointer(tmp_path) as ckptr:
        for step in range(6):
            if step % 2:
                tree = dict(tree, adapter=tree["adapter"] + step)
            if step == 4:
                tree = dict(tree, base=dict(tree["base"], w0=tree["base"]["w0"] * 2))
            ckptr.save_pytree(step, tree)
            trees[step] = tree
    for _ in range(3):
        kept = dict(trees)
        order = rng.sample(sorted(kept), rng.randint(1, 5))
        work = tmp_path.parent / f"copy{_}"
        shutil.copytree(tmp_path, work, copy_function=os.link)  # The same inodes.
        for step in order:
            shutil.rmtree(work / str(step))
            kept.pop(step)
            for other in kept:
                assert_same(cp.load_pytree(work / str(other)), trees[other])
        for other in kept:
            assert_verifies(work / str(other))


_CHANGE_SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_CHANGE_SETTINGS
@given(
    data=st.data(),
    dtype=st.sampled_from([np.float32, np.int8, np.uint16, np.bool_, jnp.bfloat16]),
    on_device=st.booleans(),
)
def test_a_changed_single_element_is_never_reused(tmp_path_factory, data, dtype, on_device):
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=80))
    size = int(np.prod(shape))
    values = np.asarray(np.random.default_rng(size).integers(0, 2, size=shape)).astype(dtype)
    if np.dtype(dtype) != np.bool_:
        values = np.asarray(np.random.default_rng(size).standard_normal(shape) * 100).astype(dtype)
    index = data.draw(st.integers(0, size - 1))
    changed = values.copy()
    flat = changed.reshape(-1)
    bits = flat.view(np.uint8 if flat.dtype.itemsize == 1 else np.uint16)
    bit = data.draw(st.integers(0, 8 * bits.dtype.itemsize - 1))
    if np.dtype(dtype) == np.bool_:
        flat[index] = not flat[index]
    else:
        position = index * (flat.dtype.itemsize // bits.dtype.itemsize)
        bits[position] ^= np.array(1 << bit, bits.dtype)
    as_leaf = jnp.asarray if on_device else np.asarray
    root = tmp_path_factory.mktemp("prop")
    # Every leaf at least reuse.MIN_BYTES, so that all are fingerprinted.
    pad = np.zeros(reuse.MIN_BYTES // 4, np.float32)
    cp.save_pytree(root / "1", {"x": as_leaf(values), "pad": pad}, reuse_from=None)
    cp.save_pytree(root / "2", {"x": as_leaf(values), "pad": pad}, reuse_from=root / "1")
    with_change = {"x": as_leaf(changed), "pad": pad}
    cp.save_pytree(root / "3", with_change, reuse_from=root / "2")
    shutil.rmtree(root / "2")
    loaded = cp.load_pytree(root / "3")
    assert np.asarray(loaded["x"]).tobytes() == changed.tobytes()


@given(
    dtype=st.sampled_from([np.float32, np.int8, np.uint16, jnp.bfloat16, np.complex64]),
    size=st.integers(1, 5000),
    data=st.data(),
)
@settings(max_examples=60, deadline=None)
def test_fingerprints_differ_for_any_single_element_change(dtype, size, data) -> None:
    values = np.asarray(np.random.default_rng(size).standard_normal(size) * 50).astype(dtype)
    index = data.draw(st.integers(0, size - 1))
    changed = values.copy()
    raw = changed.view(np.uint8).reshape(size, -1)
    byte = data.draw(st.integers(0, raw.shape[1] - 1))
    raw[index, byte] ^= np.uint8(1 << data.draw(st.integers(0, 7)))
    host = reuse.fingerprint_numpy([values, changed])
    assert host[0] != host[1] and reuse.fingerprint_numpy([values]) == host[:1]
    # Large arrays are hashed in pieces (here of 64 bytes): a flipped bit in any is seen.
    pieces = reuse.fingerprint_numpy([values, changed], piece_bytes=64)
    assert pieces[0] != pieces[1]
    assert reuse.fingerprint_numpy([values], piece_bytes=64) == pieces[:1]
    # The accelerators' reduction, run here on the CPU device: a flipped bit changes one
    # 32-bit word, which changes every lane.
    lanes = reuse.fingerprint_lanes([jnp.asarray(values), jnp.asarray(changed)])
    assert all(a != b for a, b in zip(lanes[0], lanes[1], strict=True))


_KILLED_SAVE = """
import sys, numpy as np, jax.numpy as jnp, checkpointables as cp
root = sys.argv[1]
rng = np.random.default_rng(0)
tree = {f"w{i}": jnp.asarray(rng.standard_normal((256, 1024), dtype=np.float32)) for i in range(8)}
decide = cp.training.save_decision_policies.EveryNStepsPolicy(1)
keep = cp.training.preservation_policies.LatestN(2)
with cp.training.Checkpointer(
        root, save_decision_policy=decide, preservation_policy=keep, reuse_unchanged=True) as c:
    latest = c.latest_step()
    step = latest.step + 1 if latest else 0
    while True:
        tree = dict(tree, w0=tree["w0"] + 1)
        c.save_pytree(step, tree)
        print(step, flush=True)
        step += 1
"""


def test_sigkill_during_reusing_saves_leaves_committed_steps_whole(tmp_path) -> None:
    root = tmp_path / "run"
    for delay in (1.0, 1.7, 2.4):
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_KILLED_SAVE), str(root)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        proc.stdout.readline()  # A first step committed.
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        steps = cp.training.Checkpointer(root).steps()
        assert steps
        for info in steps:
            loaded = cp.load_pytree(info.path)
            assert np.asarray(loaded["w1"]).shape == (256, 1024)
            assert_verifies(info.path)


def test_a_leaf_declared_frozen_that_changed_on_cpu_is_written(tmp_path, caplog) -> None:
    # On CPU devices probes are cheap: a declared-frozen leaf whose probes changed (the
    # predicate named a trained leaf by mistake) is written, with a WARNING, not linked.
    tree = _tree()
    declared = lambda name: name == "adapter" or name.startswith("base.")  # noqa: E731
    with (
        caplog.at_level(logging.WARNING, logger="checkpointables.reuse"),
        _checkpointer(tmp_path, reuse_unchanged=declared) as ckptr,
    ):
        ckptr.save_pytree(0, tree)
        trained = dict(tree, adapter=tree["adapter"] + 1)
        ckptr.save_pytree(1, trained)
    report = reuse.reuse_report(tmp_path / "1" / "state")
    assert report["adapter"] is None and report["base.w0"] == "0"  # The base still linked.
    assert "'adapter' is declared frozen (reuse_unchanged) but changed" in caplog.text
    assert_same(cp.load_pytree(tmp_path / "1"), trained)


def test_the_save_log_names_the_step_reused_from(tmp_path, caplog) -> None:
    tree = _tree()
    with (
        caplog.at_level(logging.INFO, logger="checkpointables.training"),
        _checkpointer(tmp_path) as ckptr,
    ):
        ckptr.save_pytree(4, tree)
        ckptr.save_pytree(5, tree)
    logged = [r.getMessage() for r in caplog.records if r.name == "checkpointables.training"]
    assert any(m.startswith("Saved step 4: ") and " reused, " in m for m in logged), logged
    assert any(m.startswith("Saved step 5: ") and " reused from 4, " in m for m in logged), logged


def test_a_frozen_predicate_shared_by_two_runs_is_checked_in_each(tmp_path, caplog) -> None:
    # The check ends for a leaf once its probes matched in a run: another run given the
    # same predicate object, where that leaf is trained, is checked afresh.
    frozen = cp.reuse.checked_frozen(lambda name: name.startswith("base."))
    tree = _tree()
    with _checkpointer(tmp_path / "a", reuse_unchanged=frozen) as ckptr:
        for step in range(2):
            ckptr.save_pytree(step, tree)  # base.* unchanged: its probes match.
    trained = dict(tree, base={k: v + 1 for k, v in tree["base"].items()})
    with (
        caplog.at_level(logging.WARNING, logger="checkpointables.reuse"),
        _checkpointer(tmp_path / "b", reuse_unchanged=frozen) as ckptr,
    ):
        ckptr.save_pytree(0, tree)
        ckptr.save_pytree(1, trained)
    said = [r.getMessage() for r in caplog.records if "declared frozen" in r.getMessage()]
    # One line for the four leaves (it was one each: 75 lines for a real model).
    assert len(said) == 1 and said[0].startswith(
        "'base.w0', 'base.w1', 'base.w2', ... (4 in all) are declared frozen (reuse_unchanged)"
    ), said
    assert_same(cp.load_pytree(tmp_path / "b" / "1"), trained)


def test_a_record_of_an_earlier_version_links_once_more_and_says_why(tmp_path, caplog) -> None:
    # Records before the list of data files ("files") cannot be checked against the files.
    tree = _tree()
    with _checkpointer(tmp_path) as ckptr:
        ckptr.save_pytree(0, tree)
    record_file = tmp_path / "0" / "state" / reuse.RECORD_FILE
    record = json.loads(record_file.read_text())
    del record["files"]
    record_file.write_text(json.dumps(record))
    with (
        caplog.at_level(logging.INFO, logger="checkpointables.reuse"),
        _checkpointer(tmp_path) as ckptr,
    ):
        ckptr.save_pytree(1, tree)
        assert ckptr.last_save_stats.bytes_reused == 0
        ckptr.save_pytree(2, tree)
        assert ckptr.last_save_stats.bytes_reused > 0
    assert "was saved by an earlier version" in caplog.text
