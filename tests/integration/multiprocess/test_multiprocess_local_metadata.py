"""``Checkpointer.metadata(step)`` of a step only the local tier holds, with real
jax.distributed processes on 127.0.0.1: each process reads a copy on its own host (its own
copy, else the peer's replica it holds) and gets the whole tree's abstract description, the
global shapes it loads with; asked by one process alone, or of a save still in flight."""

from __future__ import annotations

import json

import pytest

from .launcher import run_job

pytestmark = pytest.mark.multiprocess

# argv: root, local base. Persistent saves every 100 steps (step 0 only), local every 2.
BODY = """
import json, shutil, time
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

root, base = sys.argv[1], sys.argv[2]
MESH = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
SPECS = {"w": P("x", "y"), "b": P("x"), "r": P()}

def value(name, step):
    return {"w": np.arange(8 * 4, dtype=np.float32).reshape(8, 4) + step,
            "b": np.arange(4 * 3, dtype=np.int32).reshape(4, 3) * (step + 1),
            "r": np.full((2,), step, np.float32)}[name]

def tree(step):
    return {name: jax.make_array_from_callback(value(name, 0).shape, NamedSharding(MESH, spec),
                                               lambda i, n=name: value(n, step)[i])
            for name, spec in SPECS.items()}

def checkpointer():
    policy = cp.training.save_decision_policies.EveryNStepsPolicy
    tier = cp.training.LocalTier(f"{base}/host{PROCESS_ID}", save_decision_policy=policy(2),
                                 replicas=1, keep=2, timeout_secs=30)
    return cp.training.Checkpointer(root, save_decision_policy=policy(100), local_tier=tier)

def described(meta):
    return {"path": str(meta.path), "metrics": meta.metrics,
            "shapes": {k: [list(v.shape), str(v.dtype)] for k, v in meta.metadata.items()}}

report = {}
with checkpointer() as ckptr:
    for step in range(5):  # Local 2 and 4 (keep=2), persistent 0.
        ckptr.save_pytree(step, tree(step), metrics={"loss": 1.0 / (step + 1)})
    latest = ckptr.latest_step()
    meta = ckptr.metadata(latest.step)  # The idiom: the abstract tree of the latest step.
    report["latest"] = latest.step
    report["meta"] = described(meta)
    restored = ckptr.load_pytree(latest.step, meta.metadata)
    for name in SPECS:
        for shard in restored[name].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), value(name, 4)[shard.index])
    report["specs"] = {k: list(v.sharding.spec) for k, v in restored.items()}
    report["items"] = sorted(ckptr.checkpointables_metadata(2).metadata)
    report["persistent"] = str(ckptr.metadata(0).path)
    try:
        ckptr.metadata(3)
    except cp.training.errors.StepNotFoundError as e:
        report["missing"] = str(e)
    # One process alone asks (a logger on process 0): nothing waits for the other.
    if PROCESS_ID == 0:
        began = time.monotonic()
        report["alone"] = described(ckptr.metadata(2))
        report["alone_secs"] = time.monotonic() - began
    cp.multihost.sync_global_processes("asked alone")
    # A save still in flight: its metadata waits for the copy to be committed.
    ckptr.save_pytree_async(6, tree(6), metrics={"loss": 0.5})
    report["in_flight"] = described(ckptr.metadata(6))
# Restarted with this host's own copy of step 6 gone (process 1's): its peer's replica,
# which this host holds too, is read.
if PROCESS_ID == 1:
    shutil.rmtree(f"{base}/host1/6/p1-of-2")
    os.remove(f"{base}/host1/6/p1-of-2.manifest.json")
cp.multihost.sync_global_processes("own copy wiped")
with checkpointer() as again:
    report["restarted"] = described(again.metadata(6))
print("REPORT", json.dumps(report), flush=True)
"""

SHAPES = {"w": [[8, 4], "float32"], "b": [[4, 3], "int32"], "r": [[2], "float32"]}


def test_every_process_reads_the_metadata_of_a_local_step_from_a_copy_it_holds(
    tmp_path,
) -> None:
    args = [str(tmp_path / "persistent"), str(tmp_path / "local")]
    results = run_job(BODY, args=args, timeout=60)
    reports = []
    for result in results:
        (line,) = [x for x in result.check().stdout.splitlines() if x.startswith("REPORT ")]
        reports.append(json.loads(line[len("REPORT ") :]))
    local = tmp_path / "local"
    for process, report in enumerate(reports):
        copy = f"p{process}-of-2"
        assert report["latest"] == 4
        assert report["meta"] == {
            "path": str(local / f"host{process}" / "4" / copy),
            "metrics": {"loss": 0.2},
            "shapes": SHAPES,
        }
        assert report["specs"] == {"w": ["x", "y"], "b": ["x"], "r": []}
        assert report["items"] == ["state"]
        assert report["persistent"] == str(tmp_path / "persistent" / "0")
        assert "step 3" in report["missing"] and "local steps here: 2, 4" in report["missing"]
        assert report["in_flight"] == {
            "path": str(local / f"host{process}" / "6" / copy),
            "metrics": {"loss": 0.5},
            "shapes": SHAPES,
        }
    assert reports[0]["alone"]["path"] == str(local / "host0" / "2" / "p0-of-2")
    assert reports[0]["alone"]["shapes"] == SHAPES and reports[0]["alone_secs"] < 5
    assert reports[0]["restarted"]["path"] == str(local / "host0" / "6" / "p0-of-2")
    assert reports[1]["restarted"] == {
        "path": str(local / "host1" / "6" / "p0-of-2"),  # Process 0's replica.
        "metrics": {"loss": 0.5},
        "shapes": SHAPES,
    }
