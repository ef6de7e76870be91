"""Keeps the benchmark harness (bench/) from rotting: its quick mode, on tiny sizes.

No timing assertions: the harness is the judge of speed. This checks that
every case runs every library (the object-store cases too), that each
library's loaded values matched what was saved, that memory was measured in
subprocesses, and that every target of issue 3 got a verdict.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CASES = {"1gib", "256mib", "128mib-128kib", "small-numpy", "small-jax", "tiny-numpy", "tiny-jax"}
INTEROP_CASES = {"safetensors-1gib", "safetensors-2gib-mesh"}
LIBRARIES = {"raw", "checkpointables", "orbax", "safetensors"}


def _bench(tool: str, *args: str) -> str:
    """Runs ``python -m bench.<tool> <args>``; its output, once it succeeded."""
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{tool}", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_quick_mode_runs_every_case_library_and_target(tmp_path):
    output = tmp_path / "bench.json"
    out = _bench(
        "run", "--quick", "--scale", "0.002", "--tmp-dir", str(tmp_path), "--output", str(output)
    )
    doc = json.loads(output.read_text())

    assert doc["unavailable"] == {}, doc["unavailable"]
    assert set(doc["cases"]) == CASES | INTEROP_CASES | {"incremental"}
    incremental = doc["cases"]["incremental"]
    assert incremental["rows"]["LatestN(3) / on"]["written"] > 0, incremental
    assert incremental["rows"]["LatestN(3) / on"]["alone"] > 0, incremental  # Paired.
    assert incremental["full_change_s"]["plan"] > 0, incremental  # The detection was timed.
    for name in INTEROP_CASES:
        case = doc["cases"][name]
        assert "error" not in case, case
        assert set(case["memory"]) == {"checkpointables", "safetensors"}, name
        assert all(m["growth"] > 0 for m in case["memory"].values()), case["memory"]
    assert all(len(s["load_s"]) == 1 for s in doc["cases"]["safetensors-1gib"]["times"].values())
    for name, case in doc["cases"].items():
        if name in INTEROP_CASES or name == "incremental":
            continue
        assert case["bytes"] > 0 and case["leaves"] > 0, name
        assert set(case["libraries"]) == LIBRARIES, name
        for lib, result in case["libraries"].items():
            assert result["error"] is None, (name, lib, result["error"])
            assert result["verified"], (name, lib)
            assert len(result["save_s"]) == len(result["load_s"]) == 1, (name, lib)
            assert result["median"]["save_s"] > 0 and result["median"]["load_s"] > 0
    for name in CASES:  # The stall of an async save, in every case.
        for lib in ("checkpointables", "orbax"):
            assert len(doc["cases"][name]["libraries"][lib]["async_block_s"]) == 1, (name, lib)
    for name in ("1gib", "small-numpy"):
        for lib in ("checkpointables", "orbax"):
            for op in ("save", "save_async", "load"):
                measured = doc["cases"][name]["memory"][lib][op]
                assert measured["peak_rss"] >= measured["baseline_rss"] > 0, (lib, op, measured)

    for repeated in doc["repeated_loads"]:  # RSS over repeated loads, in a subprocess each.
        assert "error" not in repeated, repeated
        assert len(repeated["rss"]) == 8 and min(repeated["rss"]) > 0, repeated

    verdicts = {(t["case"], t["text"]): t["verdict"] for t in doc["targets"]}
    assert len(verdicts) == 16 + 3 + 5 + 9  # Incremental: 8 on a local disk, 1 on S3.
    assert set(verdicts.values()) <= {"PASS", "FAIL"}, verdicts
    assert "== targets" in out

    # The object-store cases (bench/object_store.py), against a local S3 server.
    s3 = doc["object_store"]
    assert set(s3["cases"]) == {"s3-256mib", "s3-small"}
    assert set(s3["unavailable"]) == {"orbax"}  # It cannot reach a local server.
    for name, case in s3["cases"].items():
        assert set(case["times"]) == {"raw", "checkpointables"}, name
        for lib, result in case["times"].items():
            assert result["error"] is None and result["verified"], (name, lib, result["error"])
        for op in ("save", "load"):
            assert case["requests"]["checkpointables"][op]["total"] > 0, (name, op)
    assert {t["verdict"] for t in s3["targets"]} <= {"PASS", "FAIL"}, s3["targets"]


@pytest.mark.parametrize("checkpointer", [False, True])
def test_stall_tool_runs(tmp_path, checkpointer):
    extra = ["--checkpointer"] if checkpointer else []
    out = _bench(
        "stall", "--case", "tiny-jax", "--repeats", "1", "--tmp-dir", f"{tmp_path}", *extra
    )
    assert "CPU   median" in out and "collections per generation" in out
    assert list(tmp_path.iterdir()) == []  # Its checkpoints are removed.


@pytest.mark.parametrize("op", ["save", "load"])
def test_phases_tool_times_every_phase(tmp_path, op):
    # The tool wraps functions of core and of the pytree plugin by name: a renamed one
    # makes it fail, a phase that never ran is missing from its table.
    out = _bench(
        "phases", "--case", "small-numpy", "--op", op, "--repeats", "1", "--tmp-dir", f"{tmp_path}"
    )
    phases = [line.split()[0] for line in out.splitlines() if line.startswith("    ")]
    expected = {"save": ["1", "2", "2.1", "2.1.1", "2.1.2", "2.1.3", "2.2", "3"]}
    assert phases == expected.get(op, ["1", "1.1", "2", "2.1", "2.2"]), out


@pytest.mark.multiprocess
def test_local_tier_case_runs_on_two_processes(tmp_path):
    output = tmp_path / "bench.json"
    out = _bench(
        "run",
        *("--case", "local-tier-256mib", "--scale", "0.01", "--no-memory"),
        *("--tmp-dir", str(tmp_path), "--output", str(output)),
    )
    case = json.loads(output.read_text())["cases"]["local-tier-256mib"]
    assert "error" not in case, case
    first, second = case["processes"]
    for process in (first, second):
        assert process["d2h_s"] > 0 and process["replicated_s"] >= process["local_commit_s"]
        assert process["own_disks"]["tier"] == "local" and process["own_disks"]["peers"] == 0
        assert process["one_wiped"]["persistent"] == 0
        assert process["persistent"]["tier"] == "persistent"
    assert second["one_wiped"]["peers"] > 0  # Process 1's copy came from process 0.
    assert {t["verdict"] for t in case["targets"]} <= {"PASS", "FAIL"}
    assert "local-tier-256mib: local tier" in out


def test_accelerator_tool_runs_every_measurement(tmp_path):
    # On CPU its numbers mean little (the state is host memory); what it measures on a GPU
    # must still run: a case's staging with and without the budget, and the stall.
    output = tmp_path / "accelerator.json"
    _bench(
        "accelerator",
        *("--size-mib", "16", "--budget-mib", "8", "--stall-mib", "16", "--repeats", "1"),
        *("--case", "64-arrays", "--op", "save_async", "--output", str(output)),
    )
    rows = json.loads(output.read_text())
    assert [r for r in rows if "error" in r] == []
    staging = [r for r in rows if "staging_mib" in r]
    assert len(staging) == 2 and all(r["seconds"] > 0 for r in staging)
    (stall,) = [r for r in rows if r.get("case") == "stall-16mib"]
    assert stall["device_get_s"] > 0 and stall["local_tier_stall_s"] > 0
    assert stall["roundtrip_ok"] and all(r["roundtrip_ok"] for r in staging)
