"""Peak RSS growth of one save or load, measured in a fresh subprocess.

The parent calls ``measure``; it starts ``python -m bench.memory '<json>'``,
which imports the library, does a tiny warm-up save and load (so thread
pools and one-time caches are not counted), builds the case's tree (for
saves), then records the resident set size, resets the kernel's high-water
mark (``/proc/self/clear_refs`` "5") and runs the operation. Growth is the
high-water mark (``VmHWM``) minus the starting ``VmRSS``; a thread sampling
RSS every 5 ms is the fallback where the reset is not allowed. The child
prints one JSON line.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
OPS = ("save", "save_async", "load")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_high_water_mark() -> bool:
    """Resets ``VmHWM`` to the current RSS; ``False`` if the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    # A reset high-water mark sits at the current RSS (give or take a few pages).
    return _status_kib("VmHWM") <= _status_kib("VmRSS") + 1024


class _Sampler:
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

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


def child(args: dict[str, Any]) -> dict[str, Any]:
    """Runs one measurement in this (fresh) process and returns the numbers."""
    from bench import cases, libraries

    case = cases.get_case(args["case"])
    library = libraries.all_libraries([args["library"]])[0]
    op = args["op"]

    # Warm-up on a tiny tree: imports, thread pools, JIT caches are not what we measure.
    probe_dir = libraries.scratch_dir(args["tmp_root"])
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
        libraries.remove(probe_dir)
    del probe

    tree = case.tree(args["scale"])
    spec = libraries.tree_spec(tree)  # The raw and safetensors loaders need shapes and dtypes.
    if op == "load":
        tree = None  # Freed before the baseline: a load starts from nothing.
    gc.collect()
    time.sleep(0.1)  # Let freed memory settle before the baseline.
    baseline = _status_kib("VmRSS") * 1024
    exact = _reset_high_water_mark()
    with _Sampler() as sampler:
        start = time.perf_counter()
        if op == "save":
            library.save(args["path"], tree, spec)
        elif op == "save_async":
            library.save_async(args["path"], tree, spec).result()
        else:
            result = library.load(args["path"], spec)  # Kept alive until the peak is read.
        seconds = time.perf_counter() - start
    peak = max(_status_kib("VmHWM") * 1024 if exact else 0, sampler.peak)
    if op == "load":
        del result
    return {
        "baseline_rss": baseline,
        "peak_rss": peak,
        "growth": peak - baseline,
        "seconds": seconds,
        "method": "VmHWM after clear_refs" if exact else "RSS sampled every 5 ms",
    }


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
    print(json.dumps(child(json.loads(sys.argv[1]))))
