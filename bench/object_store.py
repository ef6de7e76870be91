"""Object-store cases: checkpoints saved to and loaded from a local S3 server.

``python -m bench.run --case s3-256mib --case s3-small [--case s3-1gib]`` runs
them. The server is moto's (``python -m moto.server``) in its own process on
127.0.0.1, so its Python does not share this process's GIL. Beside
checkpointables runs a raw transfer of the same bytes through the same
server: one object per array, every request issued at once through
TensorStore's S3 key-value store (the client checkpointables uses, with the
same request concurrency), loads into fresh NumPy arrays. Orbax is listed
when it can write there.

Each case also counts requests (an untimed save and load through a counting
proxy: PUT, GET, HEAD, LIST, DELETE, and bytes per request) and measures
checkpointables' peak RSS growth of a save and a load, each in a fresh
process as for the local cases (the targets' numbers), and in this process
after the timed rounds (the server's memory is its own). The numbers of a
shared machine are rough; see docs/performance.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from bench import cases, libraries, memory, report, timing
from bench.cases import Case

__all__ = ["CASES", "CASE_NAMES", "run"]

CASES: tuple[Case, ...] = (
    Case(
        "s3-256mib",
        "256 MiB in 256 transformer-like arrays (jax.Array), S3",
        "jax",
        cases.transformer,
    ),
    Case("s3-small", "5,000 arrays of 256 B-16 KiB, NumPy, S3", "numpy", cases.small_arrays),
    Case("s3-1gib", "1 GiB in 16 float32 arrays (jax.Array), S3", "jax", cases.big_arrays),
)
CASE_NAMES = tuple(c.name for c in CASES)
# What a run without --case includes (1 GiB through moto's Python server takes minutes).
DEFAULT_CASES = ("s3-256mib", "s3-small")
# The targets: within 1.5x of the raw transfer; memory as on local disks.
TARGETS: tuple[report.Target, ...] = (
    *(
        report.Target(case, metric, "<=", 1.5, f"{what} <= 1.5x raw transfer")
        for case in ("s3-256mib", "s3-small")
        for metric, what in (("save_vs_raw", "save"), ("load_vs_raw", "load"))
    ),
    report.Target("s3-256mib", "mem_save", "<=", 0.25, "peak RSS growth, save <= 0.25x size"),
    report.Target("s3-256mib", "mem_load", "<=", 1.2, "peak RSS growth, load <= 1.2x size"),
)


class LocalS3:
    """moto's S3 server in a subprocess on a free port of 127.0.0.1, and one bucket."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self._process.poll() is not None:
                    self.stop()
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.1)
        from tests.object_store_server import aws_environment

        os.environ.update(aws_environment(self.endpoint))
        import boto3

        self.bucket = f"bench-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=self.bucket)

    def stop(self) -> None:
        """Stops the server (its objects are in its memory only)."""
        self._process.kill()
        self._process.wait(30)


def delete(path: str) -> None:
    """Deletes a checkpoint on the server."""
    import checkpointables as cp

    cp.storage.remove_tree(path)


class RawS3(libraries.Library):
    """The floor: one object per array, all requests at once, through TensorStore's S3 store."""

    name = "raw"
    api = (
        "one object per leaf through TensorStore's s3 kvstore (the client checkpointables "
        "uses, 32 requests at once): every write issued at once, then waited for; load = every "
        "read issued at once, np.frombuffer + reshape, no device_put"
    )
    returns_jax = False

    def _store(self, path: str) -> Any:
        import tensorstore as ts
        from checkpointables_pytree import storage

        return ts.KvStore.open(storage.kvstore_spec(path)).result()

    def save(self, path: str, tree: Any, spec: libraries.TreeSpec) -> None:
        import jax

        store = self._store(path)
        futures = [
            store.write(str(i), libraries._host(leaf).tobytes())  # The API takes bytes.
            for i, leaf in enumerate(jax.tree.leaves(tree))
        ]
        for future in futures:
            future.result()

    def load(self, path: str, spec: libraries.TreeSpec) -> Any:
        store = self._store(path)
        futures = [store.read(str(i)) for i in range(len(spec.leaves))]
        leaves = []
        for future, leaf in zip(futures, spec.leaves, strict=True):
            data = np.frombuffer(future.result().value, dtype=leaf.dtype).reshape(leaf.shape)
            leaves.append(data.item() if leaf.kind in ("int", "float") else data)
        return spec.treedef.unflatten(leaves)


class CheckpointablesS3(libraries.Checkpointables):
    """``cp.save_pytree`` / ``cp.load_pytree`` on ``s3://`` paths."""

    def unavailable(self) -> str | None:
        return None  # A failure shows in the first round.


class OrbaxS3(libraries.Library):
    """orbax-checkpoint, where it can write to this server."""

    name = "orbax"
    api = "orbax.checkpoint.v1 ocp.save / ocp.load on s3:// paths"

    def unavailable(self) -> str | None:
        return (
            "orbax-checkpoint 0.12 writes its metadata through etils.epath (s3:// needs s3fs, "
            "not a dependency here) and passes TensorStore the s3:// URL form, which ignores "
            "AWS_ENDPOINT_URL: it cannot reach a local S3-compatible server."
        )


def _time(
    tree: Any, libs: list[libraries.Library], root: str, args: argparse.Namespace, say: Any
) -> dict[str, timing.LibraryTimes]:
    """Median-ready save/load times per library, rounds interleaved as in bench.timing."""
    spec = libraries.tree_spec(tree)
    warm_bytes = int(args.warm_memory * cases.tree_nbytes(tree))
    results = {lib.name: timing.LibraryTimes() for lib in libs}

    def clock(fn: Callable[..., Any], *call: Any) -> tuple[float, Any]:
        gc.collect()
        timing.warm_free_memory(warm_bytes)
        timing.release_malloc_cache()
        start = time.perf_counter()
        out = fn(*call)
        return time.perf_counter() - start, out

    for round_no in range(args.warmup + args.repeats):
        for lib in libs:
            times = results[lib.name]
            if times.error is not None:
                continue
            path = f"{root}/{lib.name}-{round_no}"
            try:
                save_s, _ = clock(lib.save, path, tree, spec)
                load_s, loaded = clock(lib.load, path, spec)
                if not times.verified:
                    libraries.verify(lib, loaded, spec, tree)
                    times.verified = True
                del loaded
                if round_no >= args.warmup:
                    times.save_s.append(save_s)
                    times.load_s.append(load_s)
            except Exception as e:
                times.error = f"{type(e).__name__}: {e}"
                say(f"  {lib.name}: FAILED: {times.error}\n{traceback.format_exc(limit=4)}")
            finally:
                delete(path)
        if round_no >= args.warmup:
            say(timing.repeat_line(results, round_no - args.warmup + 1, args.repeats))
    return results


def _operations(
    lib: libraries.Library, path: str, tree: Any, spec: libraries.TreeSpec
) -> list[tuple[str, Callable[[], Any]]]:
    """A save of ``tree`` to ``path`` and a load of it, as (name, call)."""
    return [("save", lambda: lib.save(path, tree, spec)), ("load", lambda: lib.load(path, spec))]


def _count(server: LocalS3, lib: libraries.Library, tree: Any, root: str) -> dict[str, Any]:
    """Requests of one save and one load of ``lib``, through a counting proxy."""
    import checkpointables as cp

    from tests.object_store_server import S3Proxy

    spec = libraries.tree_spec(tree)
    proxy = S3Proxy(server.endpoint)
    path = f"{root}/{lib.name}-counted"
    out: dict[str, Any] = {}
    try:
        with cp.Context(storage_options=cp.options.StorageOptions(endpoint=proxy.endpoint)):
            os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint  # The raw store reads it too.
            for op, call in _operations(lib, path, tree, spec):
                with proxy.counting() as counts:
                    call()
                out[op] = {
                    "requests": dict(counts.requests),
                    "total": counts.total,
                    "bytes_sent": dict(counts.bytes_sent),
                    "bytes_received": dict(counts.bytes_received),
                }
    finally:
        os.environ["AWS_ENDPOINT_URL"] = server.endpoint
        delete(path)
        proxy.stop()
    return out


def _memory_fresh(case: Case, scale: float, root: str, size: int) -> dict[str, Any]:
    """Peak RSS growth of one save and one load, each in a fresh process (``child``) after a
    tiny save and load on the server, as ``bench.memory`` measures the local cases (what the
    targets use: the in-process numbers also hold what earlier cases left in malloc's heaps)."""
    path = f"{root}/memory-fresh"
    out: dict[str, Any] = {}
    try:
        for op in ("save", "load"):
            args = {"case": case.name, "scale": scale, "op": op, "path": path}
            numbers = memory.run_child("bench.object_store", args, f"checkpointables {op} on S3")
            growth = numbers["growth"]
            out[op] = {"growth": growth, "fraction": growth / size, "method": numbers["method"]}
    finally:
        delete(path)
    return out


def child(args: dict[str, Any]) -> dict[str, Any]:
    """One memory measurement in this fresh process (``python -m bench.object_store '<json>'``):
    ``memory.measure_here`` with checkpointables on the server the parent started."""
    case = next(c for c in CASES if c.name == args["case"])
    path = args["path"]
    return memory.measure_here(
        CheckpointablesS3(), case, args["op"], path, args["scale"], f"{path}-warm-up", delete
    )


def _memory(lib: libraries.Library, tree: Any, root: str, size: int) -> dict[str, Any]:
    """Peak RSS growth of one save and one load, in this process (fractions of ``size``)."""
    spec = libraries.tree_spec(tree)
    path = f"{root}/memory"
    out: dict[str, Any] = {}
    try:
        for op, call in _operations(lib, path, tree, spec):
            gc.collect()
            timing.release_malloc_cache()
            before = memory.status_kib("VmRSS")
            if not memory.reset_high_water_mark():
                return {"error": "this kernel does not allow resetting VmHWM"}
            result = call()
            growth = (memory.status_kib("VmHWM") - before) * 1024
            del result
            out[op] = {"growth": growth, "fraction": growth / size, "method": "VmHWM"}
    finally:
        delete(path)
    return out


def _format_counts(counts: dict[str, Any]) -> str:
    lines = []
    for op in ("save", "load"):
        c = counts[op]
        parts = []
        for method, n in sorted(c["requests"].items()):
            moved = c["bytes_sent"].get(method, 0) + c["bytes_received"].get(method, 0)
            each = f" ({moved / n / 2**20:.3f} MiB each)" if moved else ""
            parts.append(f"{method} {n}{each}")
        lines.append(f"    {op}: {c['total']} requests: {', '.join(parts)}")
    return "\n".join(lines)


def run(names: list[str], args: argparse.Namespace, say: Any) -> dict[str, Any]:
    """Runs the object-store cases ``names``; returns their part of the JSON document."""
    server = LocalS3()
    libs: list[libraries.Library] = [RawS3(), CheckpointablesS3(), OrbaxS3()]
    available = [lib for lib in libs if lib.unavailable() is None]
    document: dict[str, Any] = {
        "server": "moto (python -m moto.server) on 127.0.0.1, its own process",
        "unavailable": {lib.name: lib.unavailable() for lib in libs if lib not in available},
        "cases": {},
    }
    for name, reason in document["unavailable"].items():
        say(f"{name}: unavailable on S3, skipped ({reason})")
    results: dict[str, dict[str, Any]] = {}
    try:
        for case in [c for c in CASES if c.name in names]:
            tree = case.tree(args.scale)
            size = cases.tree_nbytes(tree)
            leaves = len(libraries.tree_spec(tree).leaves)
            say(f"\n== {case.name}: {case.title}; {leaves} leaves, {size / 2**20:.2f} MiB ==")
            root = f"s3://{server.bucket}/{case.name}"
            times = _time(tree, available, root, args, say)
            say(report.case_table(times))
            counts = {
                lib.name: _count(server, lib, tree, root)
                for lib in available
                if times[lib.name].error is None
            }
            for lib_name, c in counts.items():
                say(f"  requests, {lib_name}:\n{_format_counts(c)}")
            subject = next(lib for lib in available if lib.name == report.SUBJECT)
            mem = None
            if not args.no_memory:
                in_process = _memory(subject, tree, root, size)
                say(f"  peak RSS growth, checkpointables, in this process: {in_process}")
                fresh = _memory_fresh(case, args.scale, root, size)
                say(f"  peak RSS growth, checkpointables, fresh processes: {fresh}")
                mem = {subject.name: fresh, f"{subject.name} (in process)": in_process}
            results[case.name] = {"times": times, "memory": mem}
            document["cases"][case.name] = {
                "title": case.title,
                "bytes": size,
                "leaves": leaves,
                "times": {
                    n: {**vars(t), "median": {f: t.median(f) for f in ("save_s", "load_s")}}
                    for n, t in times.items()
                },
                "requests": counts,
                "memory": mem,
            }
            del tree
            gc.collect()
    finally:
        server.stop()
    verdicts = _evaluate(results)
    document["targets"] = verdicts
    if verdicts:
        say("\n== object-store targets ==")
        say(report.targets_table(verdicts))
    return document


def _evaluate(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for target in TARGETS:
        case = results.get(target.case)
        if case is None:
            continue
        value = report.metrics_for(report.SUBJECT, case["times"], case["memory"])[target.metric]
        verdict = "n/a" if value is None else ("PASS" if value <= target.limit else "FAIL")
        rows.append({**vars(target), "value": value, "orbax_value": None, "verdict": verdict})
    return rows


def failed(document: dict[str, Any]) -> bool:
    """Whether a library raised or returned wrong values in an object-store case."""
    for case in document["cases"].values():
        if any(t["error"] is not None for t in case["times"].values()):
            return True
        if "error" in (case["memory"] or {}).get(report.SUBJECT, {}):
            return True
    return False


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
