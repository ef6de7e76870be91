"""Where the time goes: cProfile of one save or load of one case.

    uv run python -m bench.profile --case small-numpy --op load [--lib orbax] [--scale 1]

Does one untimed warm-up round, then profiles a single save (or a save, then
a profiled load), prints the functions with the most cumulative and the
most own time, and writes the raw stats to ``bench/results/`` for
``python -m pstats`` or snakeviz. cProfile only sees Python frames: time
spent in TensorStore's C++ threads shows up as the Python call that waits.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import threading

from bench import cases, libraries
from bench.run import RESULTS_DIR


class _ThreadProfilers:
    """Profiles every Python thread started while active (the libraries' background work).

    Python 3.11 has no ``threading.setprofile_all_threads``: the hook runs on
    a new thread's first event and swaps itself for a cProfile of that thread.
    """

    def __init__(self) -> None:
        self.profilers: list[cProfile.Profile] = []

    def _hook(self, *args: object) -> None:
        profiler = cProfile.Profile()
        self.profilers.append(profiler)
        profiler.enable()  # Replaces this hook for the rest of the thread.

    def __enter__(self) -> _ThreadProfilers:
        threading.setprofile(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        threading.setprofile(None)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    """Profiles one operation; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n")[0])
    p.add_argument("--case", required=True, choices=[c.name for c in cases.CASES])
    p.add_argument("--op", required=True, choices=["save", "load", "save_async"])
    p.add_argument("--lib", default="checkpointables", choices=list(libraries.LIBRARIES))
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--top", type=int, default=30, help="rows per table")
    p.add_argument("--tmp-dir", default=None)
    args = p.parse_args(argv)

    case = cases.get_case(args.case)
    library = libraries.all_libraries([args.lib])[0]
    tree = case.tree(args.scale)
    spec = libraries.tree_spec(tree)
    scratch = libraries.scratch_dir(args.tmp_dir)
    profiler = cProfile.Profile()
    threads = _ThreadProfilers()
    try:
        warm = os.path.join(scratch, "warm")
        library.save(warm, tree, spec)
        library.load(warm, spec)
        target = os.path.join(scratch, "profiled")
        if args.op == "load":
            library.save(target, tree, spec)
        with threads:
            if args.op == "load":
                profiler.runcall(library.load, target, spec)
            elif args.op == "save":
                profiler.runcall(library.save, target, tree, spec)
            else:
                profiler.runcall(lambda: library.save_async(target, tree, spec).result())
    finally:
        libraries.remove(scratch)
    print(f"profiled the calling thread and {len(threads.profilers)} Python thread(s) it started")
    stats = pstats.Stats(profiler, stream=sys.stdout)
    for thread_profiler in threads.profilers:
        stats.add(thread_profiler)  # Sums per function over threads.
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / f"profile-{args.case}-{args.lib}-{args.op}.prof"
    stats.dump_stats(out)
    stats.strip_dirs()
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top)
    print(f"stats written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
