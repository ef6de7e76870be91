"""Peak RSS growth of one save or load, measured in a fresh subprocess.

The parent calls ``measure``; it starts ``python -m bench.memory '<json>'``,
which imports the library, does a tiny warm-up save and load (so thread
pools and one-time caches are not counted), builds the case's tree (for
saves), then records the resident set size, resets the kernel's high-water
mark (``/proc/self/clear_refs`` "5") and runs the operation. Growth is the
high-water mark (``VmHWM``) minus the starting ``VmRSS``; a thread sampling
RSS every 5 ms is the fallback where the reset is not allowed. The child
prints one JSON line. ``measure_here`` is that child's measurement, which
``bench.object_store`` runs for its cases in children of its own, so this
module knows nothing of object stores.

``repeated_loads`` measures something else: whether memory stays flat when
the same checkpoint of many small arrays is loaded again and again (a server
loading checkpoints, an evaluation loop). Its child saves the tree, loads it
``loads`` times and records the RSS after each load, once the result is
dropped, ``gc.collect()`` ran and ``malloc_trim`` handed free memory back.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.cases import Case
    from bench.libraries import Library

REPO_ROOT = Path(__file__).resolve().parent.parent
OPS = ("save", "save_async", "load")
REPEATED_LOADS = 8
# Loads before the RSS counts as warmed up (thread pools, allocator arenas, caches).
WARM_UP_LOADS = 2


def status_kib(field: str) -> int:
    """The number of kiB of ``field`` (``VmRSS``, ``VmHWM``) in ``/proc/self/status``."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_high_water_mark() -> bool:
    """Resets ``VmHWM`` to the current RSS; ``False`` if the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    # A reset high-water mark sits at the current RSS (give or take a few pages).
    return status_kib("VmHWM") <= status_kib("VmRSS") + 1024


class Sampler:
    """Samples RSS every 5 ms in a thread and keeps the maximum."""

    def __init__(self) -> None:
        import psutil

        self._process = psutil.Process()
        self.peak = self._process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


def child(args: dict[str, Any]) -> dict[str, Any]:
    """Runs one measurement of a local case in this (fresh) process and returns the numbers."""
    from bench import cases, libraries

    return measure_here(
        libraries.all_libraries([args["library"]])[0],
        cases.get_case(args["case"]),
        args["op"],
        args["path"],
        args["scale"],
        probe_dir=libraries.scratch_dir(args["tmp_root"]),
        remove=libraries.remove,
    )


def measure_here(
    library: Library,
    case: Case,
    op: str,
    path: str,
    scale: float,
    probe_dir: str,
    remove: Callable[[str], None],
) -> dict[str, Any]:
    """Peak RSS growth of one ``op`` of ``library`` on ``case``, measured in this process.

    Call it in a fresh interpreter (the child of ``run_child``): it first saves
    and loads a tiny tree under ``probe_dir`` (deleted with ``remove``), so
    imports, thread pools and one-time caches are not counted. ``path`` is
    where a save writes, or the checkpoint a load reads. Object-store cases
    (``bench.object_store``) call it with their own library and storage.
    """
    from bench import cases, libraries

    # Warm-up on a tiny tree: imports, thread pools, JIT caches are not what we measure.
    try:
        probe = cases.tiny(1.0)
        if case.leaves == "jax":
            probe = cases.to_jax(probe)
        probe_spec = libraries.tree_spec(probe)
        library.save(os.path.join(probe_dir, "a"), probe, probe_spec)
        library.load(os.path.join(probe_dir, "a"), probe_spec)
        if op == "save_async":
            library.save_async(os.path.join(probe_dir, "b"), probe, probe_spec).result()
    finally:
        remove(probe_dir)
    del probe

    tree = case.tree(scale)
    spec = libraries.tree_spec(tree)  # The raw and safetensors loaders need shapes and dtypes.
    if op == "load":
        tree = None  # Freed before the baseline: a load starts from nothing.
    gc.collect()
    time.sleep(0.1)  # Let freed memory settle before the baseline.
    baseline = status_kib("VmRSS") * 1024
    exact = reset_high_water_mark()
    with Sampler() as sampler:
        start = time.perf_counter()
        if op == "save":
            library.save(path, tree, spec)
        elif op == "save_async":
            library.save_async(path, tree, spec).result()
        else:
            result = library.load(path, spec)  # Kept alive until the peak is read.
        seconds = time.perf_counter() - start
    peak = max(status_kib("VmHWM") * 1024 if exact else 0, sampler.peak)
    if op == "load":
        del result
    return {
        "baseline_rss": baseline,
        "peak_rss": peak,
        "growth": peak - baseline,
        "seconds": seconds,
        "method": "VmHWM after clear_refs" if exact else "RSS sampled every 5 ms",
    }


def trimmed_rss() -> int:
    """RSS in bytes once garbage is collected and malloc handed free memory back."""
    import ctypes

    gc.collect()
    with contextlib.suppress(OSError):  # Not glibc: RSS then includes malloc's free lists.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return status_kib("VmRSS") * 1024


@contextlib.contextmanager
def peak_growth() -> Iterator[dict[str, float]]:
    """Measures the block: its peak RSS growth in bytes over the trimmed RSS before it
    (``growth``), that baseline (``baseline``) and its wall time (``seconds``), filled in
    the dict yielded once the block ends. Needs ``/proc/self/clear_refs`` (Linux)."""
    time.sleep(0.1)
    baseline = trimmed_rss()
    if not reset_high_water_mark():
        raise SystemExit("needs /proc/self/clear_refs")
    measured: dict[str, float] = {"baseline": baseline}
    start = time.perf_counter()
    yield measured
    measured["seconds"] = time.perf_counter() - start
    measured["growth"] = status_kib("VmHWM") * 1024 - baseline


def repeated_loads_child(args: dict[str, Any]) -> dict[str, Any]:
    """Saves ``args["leaves"]`` small arrays with checkpointables, loads them again and again."""
    import checkpointables as cp
    import numpy as np

    rng = np.random.default_rng(0)
    groups = max(1, args["leaves"] // 100)
    tree = {
        f"group_{g:04d}": {f"w_{i:03d}": rng.random(16, dtype=np.float32) for i in range(100)}
        for g in range(groups)
    }
    cp.save_pytree(args["path"], tree)
    del tree
    rss = []
    for _ in range(args["loads"]):
        loaded = cp.load_pytree(args["path"])
        del loaded
        rss.append(trimmed_rss())
    return {
        "leaves": groups * 100,
        "rss": rss,
        "growth_after_warm_up": rss[-1] - rss[min(WARM_UP_LOADS, len(rss)) - 1],
    }


def repeated_loads(leaves: int, tmp_root: str, loads: int = REPEATED_LOADS) -> dict[str, Any]:
    """RSS after each of ``loads`` loads of a checkpoint of ``leaves`` small arrays, measured
    in a fresh interpreter; ``growth_after_warm_up`` is the last minus the ``WARM_UP_LOADS``-th."""
    path = os.path.join(tmp_root, f"repeated-loads-{leaves}")
    args = {"op": "repeated_loads", "leaves": leaves, "loads": loads, "path": path}
    try:
        return run_child("bench.memory", args, "repeated loads")
    finally:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


def measure(
    case_name: str, scale: float, library: str, op: str, path: str, tmp_root: str | None
) -> dict[str, Any]:
    """Runs ``child`` in a fresh interpreter and returns its numbers.

    ``path`` is where a save writes, or the existing checkpoint a load reads.
    Raises ``RuntimeError`` with the child's stderr if it fails.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    args = {
        "case": case_name,
        "scale": scale,
        "library": library,
        "op": op,
        "path": path,
        "tmp_root": tmp_root,
    }
    return run_child("bench.memory", args, f"{library} {op}")


def run_child(
    module: str, args: dict[str, Any], what: str, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Runs ``python -m module '<args as JSON>'``; returns the JSON of its last output line.

    Raises ``RuntimeError`` with the end of the child's stderr if it fails.
    """
    proc = subprocess.run(
        [sys.executable, "-m", module, json.dumps(args)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"memory measurement {what} failed:\n{tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    _args = json.loads(sys.argv[1])
    _child = repeated_loads_child if _args.get("op") == "repeated_loads" else child
    print(json.dumps(_child(_args)))
