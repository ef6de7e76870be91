"""The benchmark command: ``uv run python -m bench.run [--quick] [--case NAME] [--repeats N]``.

Runs the cases one after another (never in parallel: the machine has two
cores), prints a table per case as it finishes, then the issue's targets with
PASS/FAIL and the memory table, and writes everything as JSON into
``bench/results/`` (or ``--output``). Exits with status 1 if a library raised
or returned wrong values, so a broken harness or library does not go unseen.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import (
    cases,
    incremental,
    interop,
    libraries,
    local_tier,
    memory,
    object_store,
    report,
    timing,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
QUICK_SCALE = 1 / 16
# raw is the floor that shows the method works: ~0x to save, ~1x to load.
MEMORY_LIBRARIES = ("raw", "checkpointables", "orbax")
# Checkpoints loaded again and again to see that RSS stays flat (scaled with --scale).
REPEATED_LOAD_LEAVES = (10_000, 100_000)
VERSIONED = (
    "checkpointables-core",
    "checkpointables-pytree",
    "orbax-checkpoint",
    "jax",
    "jaxlib",
    "tensorstore",
    "safetensors",
    "numpy",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--quick`` only changes defaults that were not given."""
    p = argparse.ArgumentParser(
        prog="python -m bench.run",
        description="Times checkpointables against orbax-checkpoint, safetensors and raw "
        "write+fsync on the cases of issue 3.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"1 repeat at {QUICK_SCALE:g} of the sizes: checks the harness in < 1 min",
    )
    p.add_argument(
        "--case",
        action="append",
        choices=[c.name for c in cases.CASES]
        + list(interop.CASES)
        + ["incremental"]
        + list(local_tier.CASES)
        + list(object_store.CASE_NAMES),
        help="run only this case (repeatable); default: all but s3-1gib",
    )
    p.add_argument(
        "--libs", default=None, help=f"comma-separated subset of {','.join(libraries.LIBRARIES)}"
    )
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (median); default 5")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first; default 1")
    p.add_argument(
        "--scale",
        type=float,
        default=None,
        help="multiply the issue's sizes and array counts; default 1",
    )
    p.add_argument(
        "--warm-memory",
        type=float,
        default=2.0,
        help="before each timed call, touch and free this many times the case's size "
        "(see bench/timing.py); 0 disables; default 2",
    )
    p.add_argument(
        "--keep-malloc-cache",
        action="store_true",
        help="do not hand malloc's free memory back to the kernel before each timed call "
        "(then a call may reuse what the previous library freed; see bench/timing.py)",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the RSS subprocesses")
    p.add_argument(
        "--tmp-dir",
        default=None,
        help="an existing directory where checkpoints are written; default /tmp",
    )
    p.add_argument("--output", default=None, help="JSON path; default bench/results/<time>.json")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    if args.scale is None:
        args.scale = QUICK_SCALE if args.quick else 1.0
    if args.repeats < 1 or args.warmup < 0 or args.scale <= 0:
        p.error("--repeats must be >= 1, --warmup >= 0 and --scale > 0")
    # Not created: the scratch directory's file system is part of what is measured, so a
    # mistyped path must not quietly put the checkpoints somewhere else.
    if args.tmp_dir is not None and not os.path.isdir(args.tmp_dir):
        what = "is not a directory" if os.path.exists(args.tmp_dir) else "does not exist"
        p.error(
            f"--tmp-dir {args.tmp_dir} {what}: create it (mkdir -p {args.tmp_dir}) "
            f"or pass an existing directory"
        )
    return args


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _filesystem(path: str) -> str:
    best, fstype = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mount, kind, *_ = line.split()
                if path.startswith(mount) and len(mount) > len(best):
                    best, fstype = mount, kind
    except OSError:
        pass
    return f"{fstype} ({best or '?'})"


def machine(tmp_root: str) -> dict[str, Any]:
    """Where the numbers come from: CPU, memory, filesystem, versions, commit."""
    import psutil

    versions = {}
    for dist in VERSIONED:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=RESULTS_DIR.parent.parent,
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip()
            or None
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=RESULTS_DIR.parent.parent,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        if commit and dirty:
            commit += " with uncommitted changes"
    except OSError:
        commit = None
    return {
        "nproc": os.cpu_count(),
        "cpu": _cpu_model(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "kernel": platform.release(),
        "filesystem": _filesystem(os.path.realpath(tmp_root)),
        "python": platform.python_version(),
        "versions": versions,
        "git_commit": commit,
        # Other work on the machine skews timings; a load average above ~0.5 is worth a re-run.
        "load_average_1min": round(os.getloadavg()[0], 2),
    }


def _say(*parts: Any) -> None:
    print(*parts, flush=True)


def _measure_memory(
    case: cases.Case,
    tree: Any,
    libs: list[libraries.Library],
    args: argparse.Namespace,
    scratch: str,
    size: int,
) -> dict[str, dict[str, Any]]:
    spec = libraries.tree_spec(tree)
    out: dict[str, dict[str, Any]] = {}
    for lib in libs:
        if lib.name not in MEMORY_LIBRARIES:
            continue
        out[lib.name] = {}
        for op in memory.OPS:
            if op == "save_async" and not lib.has_async:
                continue
            path = os.path.join(scratch, f"mem-{lib.name}-{op}")
            try:
                if op == "load":
                    lib.save(path, tree, spec)
                m = memory.measure(case.name, args.scale, lib.name, op, path, scratch)
                m["fraction"] = m["growth"] / size
                _say(
                    f"  memory {lib.name} {op}: +{m['growth'] / 2**30:.3f} GiB "
                    f"({m['fraction']:.2f}x of {size / 2**30:.3f} GiB, {m['method']})"
                )
            except Exception as e:
                m = {"error": f"{type(e).__name__}: {e}"}
                _say(f"  memory {lib.name} {op}: FAILED: {m['error']}")
            finally:
                libraries.remove(path)
            out[lib.name][op] = m
    return out


def _measure_repeated_loads(args: argparse.Namespace, scratch: str) -> list[dict[str, Any]]:
    """RSS over repeated loads of checkpoints of many small arrays (flat is the target)."""
    _say("\n== RSS over repeated loads of the same checkpoint (checkpointables) ==")
    out = []
    for leaves in REPEATED_LOAD_LEAVES:
        count = max(100, int(leaves * args.scale))
        try:
            m = memory.repeated_loads(count, scratch)
            rss = ", ".join(f"{r / 2**20:.0f}" for r in m["rss"])
            _say(
                f"  {m['leaves']:,} leaves: RSS after each load {rss} MiB; growth after warm-up "
                f"{m['growth_after_warm_up'] / 2**20:+.1f} MiB"
            )
        except Exception as e:
            m = {"leaves": count, "error": f"{type(e).__name__}: {e}"}
            _say(f"  {count:,} leaves: FAILED: {m['error']}")
        out.append(m)
    return out


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit status."""
    args = parse_args(argv)
    chosen = args.case or [c.name for c in cases.CASES] + list(interop.CASES) + [
        "incremental",
        *local_tier.DEFAULT_CASES,
        *object_store.DEFAULT_CASES,
    ]
    others = (*interop.CASES, "incremental", *local_tier.CASES, *object_store.CASE_NAMES)
    selected = [cases.get_case(n) for n in chosen if n not in others]
    on_s3 = [n for n in chosen if n in object_store.CASE_NAMES]
    libs = libraries.all_libraries(args.libs.split(",") if args.libs else None)
    scratch = libraries.scratch_dir(args.tmp_dir)
    started = time.strftime("%Y%m%d-%H%M%S")
    document: dict[str, Any] = {
        "command": " ".join(["python -m bench.run", *(argv if argv is not None else sys.argv[1:])]),
        "started": started,
        "settings": {
            "repeats": args.repeats,
            "warmup": args.warmup,
            "scale": args.scale,
            "quick": args.quick,
            "warm_memory": args.warm_memory,
            "release_malloc_cache": not args.keep_malloc_cache,
        },
        "machine": machine(scratch),
        "apis": {lib.name: lib.api for lib in libs},
        "unavailable": {},
        "cases": {},
    }
    _say(
        f"checkpoints under {scratch}; repeats={args.repeats} warmup={args.warmup} "
        f"scale={args.scale:g}"
    )
    available = []
    for lib in libs:
        reason = lib.unavailable()
        if reason:
            document["unavailable"][lib.name] = reason
            _say(f"{lib.name}: unavailable, skipped ({reason.splitlines()[0][:200]})")
        else:
            available.append(lib)
    failed = False
    results: dict[str, dict[str, Any]] = {}
    try:
        for case in selected:
            tree = case.tree(args.scale)
            size = cases.tree_nbytes(tree)
            leaves = len(libraries.tree_spec(tree).leaves)
            _say(f"\n== {case.name}: {case.title}; {leaves} leaves, {size / 2**20:.2f} MiB ==")
            times = timing.time_case(
                case,
                tree,
                available,
                repeats=args.repeats,
                warmup=args.warmup,
                root=scratch,
                warm_bytes=int(args.warm_memory * size),
                release_malloc=not args.keep_malloc_cache,
                progress=_say,
            )
            mem = None
            if case.measure_memory and not args.no_memory:
                mem = _measure_memory(case, tree, available, args, scratch, size)
            del tree
            gc.collect()
            failed |= any(t.error for t in times.values())
            failed |= any("error" in m for ops in (mem or {}).values() for m in ops.values())
            results[case.name] = {"times": times, "memory": mem}
            _say(report.case_table(times))
            document["cases"][case.name] = {
                "title": case.title,
                "bytes": size,
                "leaves": leaves,
                "libraries": {
                    name: {
                        **{k: v for k, v in vars(t).items()},
                        "median": {
                            f: t.median(f)
                            for f in ("save_s", "load_s", "async_block_s", "async_total_s")
                        },
                        "min": {f: min(getattr(t, f), default=None) for f in ("save_s", "load_s")},
                        "max": {f: max(getattr(t, f), default=None) for f in ("save_s", "load_s")},
                        "metrics": report.metrics_for(name, times, mem),
                    }
                    for name, t in times.items()
                },
                "memory": mem,
            }
        for name in (n for n in chosen if n in interop.CASES):
            document["cases"][name] = result = interop.run_case(name, args, scratch, _say)
            failed |= "error" in result or any(
                "error" in m for m in result.get("memory", {}).values()
            )
        if "incremental" in chosen:
            document["cases"]["incremental"] = incremental.run_case(args, scratch, _say)
        for name in (n for n in chosen if n in local_tier.CASES):
            document["cases"][name] = result = local_tier.run_case(name, args, scratch, _say)
            failed |= "error" in result
        if not args.no_memory:
            document["repeated_loads"] = _measure_repeated_loads(args, scratch)
            failed |= any("error" in m for m in document["repeated_loads"])
        if on_s3:
            document["object_store"] = object_store.run(on_s3, args, _say)
            failed |= object_store.failed(document["object_store"])
    finally:
        libraries.remove(scratch)
    verdicts = report.evaluate(results)
    verdicts += [row for c in document["cases"].values() for row in c.get("targets", [])]
    document["targets"] = verdicts
    if verdicts:
        note = " (quick/scaled run: sizes differ from the issue's)" if args.scale != 1 else ""
        _say(f"\n== targets{note} ==")
        _say(report.targets_table(verdicts))
    for name, r in results.items():
        if r["memory"]:
            _say(f"\n== peak RSS growth, {name} ==")
            _say(report.memory_table(r["memory"]))
    suffix = "-quick" if args.quick else ""
    output = args.output or str(RESULTS_DIR / f"bench-{started}{suffix}.json")
    report.write_json(output, document)
    _say(f"\nresults written to {output}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
