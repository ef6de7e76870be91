"""The local tier on 2 ``jax.distributed`` processes on 127.0.0.1 (gloo, CPU devices).

``python -m bench.run --case local-tier-256mib`` (or ``local-tier-1gib``) runs
one job of 2 processes, each with 2 CPU devices, holding a state of the
case's size sharded over the 4 devices, and measures in each process:

- the device-to-host copy of its shards (``np.array(shard.data, copy=True)``), and
  the time ``save_checkpointables_async`` of a local-only step blocks the
  caller; then until the local commit, and until replication to the peer
  finished (``wait()``);
- after an untimed warm-up restore: a restore from own disks, a restore with
  process 1's local directory wiped (its copy comes from process 0), and a
  restore from the persistent tier (every local directory wiped); bytes per
  tier from ``last_restore_stats``.

The persistent tier is a local directory here, as fast as the local tier;
its restore time is also given throttled to 1 GB/s per host: the larger of
the measured time and the step's bytes / 1 GB/s (a floor, not a real
throttle, so the ratio to a restore from peers is low on one machine). Numbers on a shared
2-core machine are rough; the targets are the issue's.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import traceback
from collections.abc import Callable
from typing import Any

from bench import report

__all__ = ["CASES", "run_case"]

THROTTLE_BYTES_PER_SEC = 1e9

BODY = """
import json, os, shutil, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
me = int(os.environ["BENCH_PROCESS_ID"])
jax.distributed.initialize(os.environ["BENCH_COORDINATOR"], 2, me, initialization_timeout=60)
import numpy as np
import checkpointables as cp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

base, total = os.environ["BENCH_DIR"], int(os.environ["BENCH_BYTES"])
mesh = Mesh(np.array(jax.devices()), ("d",))
sharding = NamedSharding(mesh, P("d"))
rows = max(4, total // 16 // 4 // 1024 // 4 * 4)
state = {f"a{i}": jax.make_array_from_callback(
    (rows, 1024), sharding, lambda idx, i=i: np.full((rows, 1024), i, np.float32)[idx])
    for i in range(16)}
abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in state.items()}
EveryN = cp.training.save_decision_policies.EveryNStepsPolicy

def checkpointer():
    tier = cp.training.LocalTier(f"{base}/host{me}", save_decision_policy=EveryN(10),
                                 replicas=1, keep=2, timeout_secs=300)
    return cp.training.Checkpointer(f"{base}/persistent", save_decision_policy=EveryN(1000),
                                    local_tier=tier)

out = {"bytes": sum(v.nbytes for v in state.values())}
ckptr = checkpointer()
ckptr.save_checkpointables(0, {"state": state})           # both tiers
ckptr.save_checkpointables(10, {"state": state})          # local only: warm
t = time.perf_counter()
# A real copy: on CPU devices np.asarray would share the device buffer.
copies = [np.array(s.data, copy=True) for v in state.values() for s in v.addressable_shards]
out["d2h_s"] = time.perf_counter() - t
out["host_bytes"] = sum(c.nbytes for c in copies)
del copies
ckptr.wait()
t = time.perf_counter()
response = ckptr.save_checkpointables_async(20, {"state": state})
out["save_blocked_s"] = time.perf_counter() - t
response.result()
out["local_commit_s"] = time.perf_counter() - t
ckptr.wait()
out["replicated_s"] = time.perf_counter() - t
ckptr.close()

def restore(name):
    with checkpointer() as c:
        t = time.perf_counter()
        restored = c.load_checkpointables(None, {"state": abstract})["state"]
        secs = time.perf_counter() - t
        s = c.last_restore_stats
    for k, v in restored.items():
        for shard in v.addressable_shards:
            assert float(np.asarray(shard.data).ravel()[0]) == int(k[1:])
    out[name] = {"secs": secs, "step": s.step, "tier": s.tier, "local": s.bytes_from_local,
                 "peers": s.bytes_from_peers, "persistent": s.bytes_from_persistent}

restore("warm_up")  # Untimed: the first load in a process pays for imports and compiles.
restore("own_disks")
if me == 1:  # After every process closed its Checkpointer (the close is a barrier).
    shutil.rmtree(f"{base}/host1")
restore("one_wiped")
shutil.rmtree(f"{base}/host{me}")
restore("persistent")
print("RESULT " + json.dumps(out), flush=True)
# Both done before either leaves: process 0 runs the coordination service, and a process
# whose service vanished mid-restore is aborted by JAX.
cp.multihost.sync_global_processes("bench-local-tier-done")
jax.distributed.shutdown()
os._exit(0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job(total_bytes: int, scratch: str, timeout: float) -> list[dict[str, Any]]:
    base = tempfile.mkdtemp(prefix="local-tier-", dir=scratch)
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = []
    try:
        for i in range(2):
            env = {
                **os.environ,
                "BENCH_PROCESS_ID": str(i),
                "BENCH_COORDINATOR": coordinator,
                "BENCH_DIR": base,
                "BENCH_BYTES": str(total_bytes),
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", textwrap.dedent(BODY)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        results = []
        for i, proc in enumerate(procs):
            out, err = proc.communicate(timeout=timeout)
            line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                raise RuntimeError(f"process {i} exited {proc.returncode}: {err[-3000:]}")
            results.append(json.loads(line[len("RESULT ") :]))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        shutil.rmtree(base, ignore_errors=True)


def _targets(name: str, procs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    stall = max(p["save_blocked_s"] / p["d2h_s"] for p in procs)
    wiped = max(p["one_wiped"]["secs"] for p in procs) / max(p["own_disks"]["secs"] for p in procs)
    from_persistent = sum(p["one_wiped"]["persistent"] for p in procs)
    throttled = max(
        max(p["persistent"]["secs"], p["persistent"]["persistent"] / THROTTLE_BYTES_PER_SEC)
        for p in procs
    )
    speedup = throttled / max(p["one_wiped"]["secs"] for p in procs)
    rows = [
        ("save_stall_vs_d2h", "<=", 1.1, stall, "local save stall <= 1.1x D2H copy"),
        ("wiped_restore_persistent_bytes", "<=", 0, from_persistent,
         "restore, one host wiped: 0 B from persistent"),
        ("wiped_vs_own_disks", "<=", 1.5, wiped, "restore, one host wiped <= 1.5x own disks"),
        ("peers_vs_persistent_1gbps", ">=", 10, speedup,
         "restore from peers >= 10x persistent at 1 GB/s"),
    ]  # fmt: skip
    return [report.target_row(name, *row) for row in rows]


def _run(name: str, total_bytes: int, args: Any, scratch: str, say: Callable[..., None]) -> dict:
    size = int(total_bytes * args.scale)
    say(f"\n== {name}: local tier, 2 processes x 2 CPU devices, {size / 2**20:.0f} MiB state ==")
    procs = _job(size, scratch, timeout=600)
    for i, p in enumerate(procs):
        say(
            f"  process {i}: D2H {p['d2h_s']:.3f} s, save blocked {p['save_blocked_s']:.3f} s, "
            f"local commit {p['local_commit_s']:.3f} s, replicated {p['replicated_s']:.3f} s"
        )
        for what in ("own_disks", "one_wiped", "persistent"):
            r = p[what]
            say(
                f"    restore {what}: step {r['step']} ({r['tier']}) {r['secs']:.3f} s; "
                f"{r['local'] / 2**20:.0f} MiB local, {r['peers'] / 2**20:.0f} MiB peers, "
                f"{r['persistent'] / 2**20:.0f} MiB persistent"
            )
    return {"bytes": size, "processes": procs, "targets": _targets(name, procs)}


CASES: dict[str, Callable[..., dict[str, Any]]] = {
    "local-tier-256mib": lambda args, scratch, say: _run(
        "local-tier-256mib", 256 * 2**20, args, scratch, say
    ),
    "local-tier-1gib": lambda args, scratch, say: _run(
        "local-tier-1gib", 2**30, args, scratch, say
    ),
}
# What a run without --case includes: none (a multi-process job; ask for it with --case).
DEFAULT_CASES: tuple[str, ...] = ()


def run_case(name: str, args: Any, scratch: str, say: Callable[..., None]) -> dict[str, Any]:
    """Runs local-tier case ``name``; a failure is recorded under ``error``, not raised."""
    try:
        return CASES[name](args, scratch, say)
    except Exception as e:
        say(f"  {name}: FAILED: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
