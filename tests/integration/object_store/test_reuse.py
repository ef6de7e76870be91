"""Incremental saves on the S3 test server: unchanged data files are copied on the server.

The bytes uploaded are counted by a proxy in front of the server (the bodies of
the requests it receives), not by the library. Every step must be an ordinary,
complete checkpoint: its own objects, loading bit-exact and passing ``verify``
after the step it reused is deleted, and readable by Orbax.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time

import boto3
import checkpointables as cp
import jax.numpy as jnp
import numpy as np
import pytest
from checkpointables_pytree import reuse, storage

from ...object_store_server import S3Proxy, _client_args, aws_environment
from .helpers import assert_equal, keys, tree

# Reuse is the fast path's (our own database writer's): CI's run with it off keeps it on here.
pytestmark = pytest.mark.fast_path

MiB = 1 << 20


@pytest.fixture
def proxy(s3, monkeypatch):
    """A counting proxy in front of the server, where the library's requests go."""
    proxy = S3Proxy(s3.endpoint)
    for name, value in aws_environment(proxy.endpoint).items():
        monkeypatch.setenv(name, value)
    yield proxy
    proxy.stop()


def _state(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "base": {
            f"w{i}": jnp.asarray(rng.standard_normal((256, 1024), np.float32)) for i in range(4)
        },
        "ema": rng.standard_normal((128, 1024), np.float32),  # 512 KiB, on the host.
        "adapter": jnp.asarray(rng.standard_normal((64, 1024), np.float32)),  # 256 KiB.
        "step": 0,
    }


def _uploaded(counts) -> int:
    """Bytes of request bodies the server received (PUTs, parts and POSTs)."""
    return counts.bytes_sent["PUT"] + counts.bytes_sent["POST"]


def _verify(path: str) -> None:
    _cli("verify", path)


def _checkpointer(root: str, keep=None) -> cp.training.Checkpointer:
    return cp.training.Checkpointer(
        root,
        preservation_policy=keep or cp.training.preservation_policies.PreserveAll(),
        save_decision_policy=cp.training.save_decision_policies.EveryNStepsPolicy(1),
        reuse_unchanged=True,
    )


def test_reuse_across_steps_uploads_only_the_changed_bytes(s3, proxy, bucket) -> None:
    state = _state()
    base_bytes = sum(int(a.nbytes) for a in state["base"].values())
    trees, uploads = {}, {}
    with _checkpointer(f"{bucket}/run") as ckptr:
        for step in range(4):
            state = dict(state, adapter=state["adapter"] * 1.5, step=step)
            if step == 2:  # An array that changes rarely (an EMA).
                state["ema"] = state["ema"] + 1
            with proxy.counting() as counts:
                ckptr.save_pytree(step, state)
            trees[step], uploads[step] = state, _uploaded(counts)
            stats = ckptr.last_save_stats
            changed = state["adapter"].nbytes + (state["ema"].nbytes if step == 2 else 0)
            if step == 0:
                assert stats.bytes_reused == 0
                assert uploads[step] >= base_bytes
            else:
                reused = base_bytes + (0 if step == 2 else state["ema"].nbytes)
                assert stats.bytes_reused == reused, step
                assert uploads[step] <= changed + MiB, (step, uploads[step], changed)
                assert counts.requests["PUT"] >= 4  # The copies: PUTs without a body.
    name = bucket.removeprefix("s3://")
    copied = [k for k in keys(s3, f"{bucket}/run/3") if "/d/r" in k]
    assert len(copied) >= 4, copied  # Objects of step 3's own prefix.
    for step in range(3):  # Every step 3 took its data from, and the ones before.
        client = boto3.client("s3", **_client_args(s3.endpoint))
        for key in keys(s3, f"{bucket}/run/{step}"):
            client.delete_object(Bucket=name, Key=f"run/{step}/{key}")
    assert_equal(cp.load_pytree(f"{bucket}/run/3"), trees[3])
    _verify(f"{bucket}/run/3")
    shown = _cli("inspect", f"{bucket}/run/3")
    assert "    adapter: written" in shown and "    base.w0: reused from 2" in shown, shown


def _cli(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "checkpointables", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _damaged(body: bytes, how: str) -> bytes:
    if how == "short":  # A torn copy: its last byte lost.
        return body[:-1]
    middle = len(body) // 2  # Rewritten with one bit flipped: its size, another ETag.
    return body[:middle] + bytes([body[middle] ^ 1]) + body[middle + 1 :]


@pytest.mark.parametrize("how", ["short", "flipped", "unlisted"])
def test_a_short_or_replaced_source_object_is_written_afresh(s3, proxy, bucket, how) -> None:
    # Unlisted: flipped, and the record lists no objects (one written elsewhere, uploaded):
    # nothing is known to match, and nothing is copied.
    state = _state()
    cp.save_pytree(f"{bucket}/1", state, reuse_from=None)
    cp.save_pytree(f"{bucket}/2", state, reuse_from=f"{bucket}/1")
    client = boto3.client("s3", **_client_args(s3.endpoint))
    name = bucket.removeprefix("s3://")
    for key in keys(s3, f"{bucket}/2/pytree/d"):  # Every array's data object.
        body = client.get_object(Bucket=name, Key=f"2/pytree/d/{key}")["Body"].read()
        if len(body) > reuse.MIN_BYTES:
            client.put_object(Bucket=name, Key=f"2/pytree/d/{key}", Body=_damaged(body, how))
    if how == "unlisted":
        record_key = f"2/pytree/{reuse.RECORD_FILE}"
        record = json.loads(client.get_object(Bucket=name, Key=record_key)["Body"].read())
        del record["files"]
        client.put_object(Bucket=name, Key=record_key, Body=json.dumps(record).encode())
    with proxy.counting() as counts:
        cp.save_pytree(f"{bucket}/3", state, reuse_from=f"{bucket}/2")
    assert _uploaded(counts) >= sum(int(a.nbytes) for a in state["base"].values())
    assert not [k for k in keys(s3, f"{bucket}/3") if "/d/r" in k]
    assert_equal(cp.load_pytree(f"{bucket}/3"), state)


def test_retention_waits_for_a_save_reusing_the_step(s3, proxy, bucket) -> None:
    """LatestN(1) deletes step 0 after step 1 commits: never while step 1 copies from it."""
    state = _state()
    keep = cp.training.preservation_policies.LatestN(1)
    with _checkpointer(f"{bucket}/run", keep) as ckptr:
        ckptr.save_pytree(0, state)
        response = ckptr.save_pytree_async(1, dict(state, adapter=state["adapter"] + 1))
        assert cp.is_checkpoint(f"{bucket}/run/0")  # Leased while the save reuses it.
        assert response.result()
        assert ckptr.last_save_stats.bytes_reused > 0
        ckptr.save_pytree(2, state)
    assert [s.step for s in cp.training.Checkpointer(f"{bucket}/run").steps()] == [2]
    assert_equal(cp.load_pytree(f"{bucket}/run/2"), state)
    _verify(f"{bucket}/run/2")


@pytest.mark.filterwarnings("ignore::UserWarning")  # Orbax warns about our typestr, its shardings.
def test_orbax_loads_a_reusing_step(s3, proxy, bucket, tmp_path) -> None:
    """Orbax cannot reach a local server: the step travels to a local directory unchanged."""
    from orbax.checkpoint import v1 as ocp

    state = _state()
    cp.save_pytree(f"{bucket}/1", state, reuse_from=None)
    cp.save_pytree(f"{bucket}/2", state, reuse_from=f"{bucket}/1")
    cp.save_pytree(f"{bucket}/3", state, reuse_from=f"{bucket}/2")
    client = boto3.client("s3", **_client_args(s3.endpoint))
    name = bucket.removeprefix("s3://")
    stored = keys(s3, f"{bucket}/3")
    assert [k for k in stored if "/d/r" in k]
    for key in stored:
        target = tmp_path / "3" / key
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(client.get_object(Bucket=name, Key=f"3/{key}")["Body"].read())
    loaded = ocp.load(tmp_path / "3")
    for key in ("adapter", "ema"):
        assert np.asarray(loaded[key]).tobytes() == np.asarray(state[key]).tobytes()
    for key, value in state["base"].items():
        assert np.asarray(loaded["base"][key]).tobytes() == np.asarray(value).tobytes()


def test_reuse_between_local_disk_and_s3_writes_everything_and_says_so_once(
    bucket, tmp_path, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="checkpointables.reuse")
    cp.save_pytree(tmp_path / "1", tree(1))
    for step in (2, 3):
        cp.save_pytree(f"{bucket}/{step}", tree(1), reuse_from=tmp_path / "1")
        assert_equal(cp.load_pytree(f"{bucket}/{step}"), tree(1))
    said = [r.getMessage() for r in caplog.records if r.name == "checkpointables.reuse"]
    assert len(said) == 1 and "is on other storage than this save" in said[0], said


def test_an_export_of_a_step_on_s3_copies_from_its_state(s3, bucket) -> None:
    # A Checkpointer names its tree "state", cp.save_pytree "pytree": the export reuses
    # from the step's only pytree, and the record names the step by its path.
    state = _state()
    with _checkpointer(f"{bucket}/run") as ckptr:
        ckptr.save_pytree(0, state)
    cp.save_pytree(f"{bucket}/export", state, reuse_from=f"{bucket}/run/0")
    report = reuse.reuse_report(cp.path.as_path(f"{bucket}/export/pytree"))
    assert report == dict.fromkeys(
        ["adapter", "base.w0", "base.w1", "base.w2", "base.w3", "ema"], f"{bucket}/run/0"
    ), report
    client = boto3.client("s3", **_client_args(s3.endpoint))
    for key in keys(s3, f"{bucket}/run/0"):
        client.delete_object(Bucket=bucket.removeprefix("s3://"), Key=f"run/0/{key}")
    assert_equal(cp.load_pytree(f"{bucket}/export"), state)
    _verify(f"{bucket}/export")


def test_a_checkpointer_on_s3_reuses_by_default(bucket) -> None:
    with cp.training.Checkpointer(f"{bucket}/run") as ckptr:
        ckptr.save_pytree(0, tree(1), force=True)
        ckptr.save_pytree(1, tree(1), force=True)
        assert ckptr.last_save_stats.bytes_reused > 0


def test_large_objects_are_copied_in_parts(s3, bucket) -> None:
    client = boto3.client("s3", **_client_args(s3.endpoint))
    name = bucket.removeprefix("s3://")
    data = np.random.default_rng(0).bytes(11 * MiB + 3)
    client.put_object(Bucket=name, Key="a/d/x", Body=data)
    listed = storage.list_objects(f"{bucket}/a/d")
    copy = storage.ServerCopy(f"{bucket}/a/d/x", f"{bucket}/b/d/rx", listed[f"{bucket}/a/d/x"])
    # Parts of S3's smallest size, so that a small object takes the path of a 5 GiB one.
    storage.copy_objects([copy], single_copy_bytes=MiB, part_bytes=5 * MiB)
    assert client.get_object(Bucket=name, Key="b/d/rx")["Body"].read() == data
    head = client.head_object(Bucket=name, Key="b/d/rx")
    assert head["ETag"].strip('"').endswith("-3")  # Three parts: a multipart object.


def test_a_copy_whose_source_is_gone_fails_and_leaves_nothing(s3, bucket) -> None:
    client = boto3.client("s3", **_client_args(s3.endpoint))
    name = bucket.removeprefix("s3://")
    info = storage.ObjectInfo(12 * MiB, '"0123"')
    for single in (64 * MiB, MiB):  # Whole, then in parts.
        copy = storage.ServerCopy(f"{bucket}/gone", f"{bucket}/new/d/r1", info)
        with pytest.raises(cp.errors.StorageError, match="deleted or replaced"):
            storage.copy_objects([copy], single_copy_bytes=single, part_bytes=5 * MiB)
    assert keys(s3, f"{bucket}/new") == []
    assert not client.list_multipart_uploads(Bucket=name).get("Uploads")


_KILLED = """
import sys
import numpy as np
import checkpointables as cp

rng = np.random.default_rng(0)
base = {f"w{i}": rng.standard_normal((256, 1024), np.float32) for i in range(8)}
keep = cp.training.preservation_policies.LatestN(2)
every = cp.training.save_decision_policies.EveryNStepsPolicy(1)
with cp.training.Checkpointer(
    sys.argv[1], preservation_policy=keep, save_decision_policy=every, reuse_unchanged=True
) as ckptr:
    latest = ckptr.latest_step()
    step = latest.step + 1 if latest else 0
    while True:
        ckptr.save_pytree(step, {"base": base, "adapter": np.full(1 << 16, step, np.float32)})
        print(step, flush=True)
        step += 1
"""


@pytest.mark.slow
def test_sigkill_during_reusing_saves_leaves_committed_steps_whole(s3, bucket) -> None:
    root = f"{bucket}/run"
    for delay in (0.3, 0.9, 1.6):
        with subprocess.Popen(
            [sys.executable, "-c", _KILLED, root], stdout=subprocess.PIPE, text=True
        ) as process:
            assert process.stdout is not None
            process.stdout.readline()  # A step committed (bounded: it prints or dies).
            time.sleep(delay)
            process.send_signal(signal.SIGKILL)
            process.wait(60)
    committed = {k.split("/")[0] for k in keys(s3, root) if k.endswith("/commit_success.txt")}
    assert committed
    for name in committed:
        loaded = cp.load_pytree(f"{root}/{name}")
        assert np.array_equal(loaded["adapter"], np.full(1 << 16, int(name), np.float32))
        _verify(f"{root}/{name}")
    with cp.training.Checkpointer(root) as ckptr:
        assert {str(s.step) for s in ckptr.steps()} == committed
        ckptr.wait()  # Its cleanup of what the kills left.
    left = {k.split("/")[0] for k in keys(s3, root)} - committed - {"metadata"}
    assert not left, left


def test_a_reusing_save_blocks_for_its_source_identity_only(s3, proxy, bucket) -> None:
    # The record, b-tree and data files' listing of the step just committed are read back
    # after its commit: the next save's blocking phase asks for the version of the source's
    # commit marker (which commit it is: a HEAD), besides what a plain save does (a HEAD and
    # a LIST).
    state = _state()
    with _checkpointer(f"{bucket}/run") as ckptr:
        for step in range(3):
            state = dict(state, adapter=state["adapter"] + 1, step=step)
            ckptr.wait()
            with proxy.counting() as counts:
                ckptr.save_pytree_async(step, state)
                blocking = dict(counts.requests)
            ckptr.wait()
        assert ckptr.last_save_stats.bytes_reused == 4 * MiB + 512 * 1024  # base, ema.
    assert blocking == {"HEAD": 2, "LIST": 1}
    assert_equal(cp.load_pytree(f"{bucket}/run/2"), state)


def test_a_step_replaced_after_its_commit_is_read_afresh(s3, proxy, bucket) -> None:
    # What was read back after step 0's commit is kept under that commit's identity: once
    # another writer replaces step 0, the next save reads the new one (its record: none).
    state = _state()
    with _checkpointer(f"{bucket}/run") as ckptr:
        ckptr.save_pytree(0, state)
        cp.save_pytree(f"{bucket}/run/0", state, checkpointable_name="state", overwrite=True)
        with proxy.counting() as counts:
            ckptr.save_pytree_async(1, state)
            blocking = dict(counts.requests)
        ckptr.wait()
        assert ckptr.last_save_stats.bytes_reused == 0  # No record there, and no bytes read.
    assert blocking.get("GET", 0) >= 1  # Its record (there is none) read afresh.
    assert_equal(cp.load_pytree(f"{bucket}/run/1"), state)


def test_a_source_object_replaced_after_its_read_back_fails_one_save_only(
    s3, proxy, bucket
) -> None:
    # Step 0's objects were listed after its commit; one replaced since (same size,
    # another ETag) is refused by the conditional copy: that save fails, committing
    # nothing, and the next lists afresh and writes it.
    state = _state()
    client = boto3.client("s3", **_client_args(s3.endpoint))
    name = bucket.removeprefix("s3://")
    with _checkpointer(f"{bucket}/run") as ckptr:
        ckptr.save_pytree(0, state)
        ckptr.wait()  # Its read-back.
        for key in keys(s3, f"{bucket}/run/0/state/d"):
            body = client.get_object(Bucket=name, Key=f"run/0/state/d/{key}")["Body"].read()
            if len(body) > reuse.MIN_BYTES:
                damaged = _damaged(body, "flipped")
                client.put_object(Bucket=name, Key=f"run/0/state/d/{key}", Body=damaged)
        with pytest.raises(cp.errors.StorageError, match="deleted or replaced"):
            ckptr.save_pytree(1, state)
            ckptr.wait()
        assert not cp.is_checkpoint(f"{bucket}/run/1")
        with proxy.counting() as counts:
            ckptr.save_pytree(2, state)
            ckptr.wait()
        assert ckptr.last_save_stats.bytes_reused == 0
    assert _uploaded(counts) >= sum(int(a.nbytes) for a in state["base"].values())
    assert_equal(cp.load_pytree(f"{bucket}/run/2"), state)
