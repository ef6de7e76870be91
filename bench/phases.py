"""Where the wall time of one save or load goes, phase by phase, next to safetensors.

    uv run python -m bench.phases --case small-numpy --op save [--repeats 10]

Wraps the main phases of core's save (or load) and of the pytree plugin's
writer (or reader) with timers, runs the operation ``--repeats`` times after
two untimed rounds, alternating with safetensors (``save_file`` + fsync, or
``load_file``) on the same tree, and prints the median of each phase. Nested
phases are indented; phases that overlap (the ``_METADATA`` file is written
while TensorStore commits the arrays) do not add up. Unlike ``bench.profile``
(cProfile), this costs next to nothing, so the times are those of a real call.
It also prints the CPU time of the process (every thread), which other work
on the machine changes less than the wall time.
"""

from __future__ import annotations

import argparse
import collections
import functools
import inspect
import os
import resource
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench import cases, libraries

_spent: dict[str, float] = collections.defaultdict(float)


def _timed(owner: Any, name: str, label: str) -> None:
    """Replaces ``owner.name`` by a version adding its wall time to ``_spent[label]``."""
    original = getattr(owner, name)
    if inspect.iscoroutinefunction(original):

        async def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return await original(*args, **kwargs)
            finally:
                _spent[label] += time.perf_counter() - start

    else:

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                _spent[label] += time.perf_counter() - start

    setattr(owner, name, functools.wraps(original)(timed))


def _instrument(op: str) -> None:
    from checkpointables import _loading, _saving
    from checkpointables_pytree import _load_plan, io, ocdbt, tree

    # Wrapped where their callers look them up: the modules that define them.
    from checkpointables_pytree.ocdbt import _database_writer
    from checkpointables_pytree.tree import _metadata_file

    if op == "save":
        _timed(_saving, "_blocking_phase", "1 blocking phase: flatten, checks, snapshot")
        _timed(_saving, "_write", "2 background phase: writes")
        _timed(io.Writer, "run", "2.1 writer (the database, large arrays)")
        _timed(io.Writer, "_database_layout", "2.1.1 the database's layout (per structure)")
        _timed(ocdbt.DatabaseLayout, "btree_file", "2.1.2 b-tree nodes filled")
        # On threads, overlapping each other and the encoding: the sum of their times.
        _timed(_database_writer, "write_local_file", "2.1.3 files written and flushed (sum)")
        _timed(tree, "write_tree_metadata", "2.2 _METADATA (overlaps 2.1)")
        _timed(_saving, "_commit_save", "3 commit: metadata, fsyncs, rename")
    else:
        _timed(_loading, "_blocking_phase", "1 blocking phase: metadata, read plan")
        _timed(_metadata_file, "parse_tree_metadata", "1.1 parsing _METADATA")
        _timed(_loading, "_read", "2 background phase: reads")
        _timed(io.Reader, "run", "2.1 reader (index, preads, CRC-32C)")
        _timed(_load_plan.LoadPlan, "build", "2.2 the tree built")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _clock(fn: Callable[[], Any]) -> tuple[float, float]:
    cpu, start = _cpu(), time.perf_counter()
    fn()
    return time.perf_counter() - start, _cpu() - cpu


def main(argv: list[str] | None = None) -> None:
    """Prints the medians of each phase of ``--op`` on ``--case``."""
    p = argparse.ArgumentParser(prog="python -m bench.phases", description=__doc__)
    p.add_argument("--case", required=True, choices=[c.name for c in cases.CASES])
    p.add_argument("--op", required=True, choices=["save", "load"])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--tmp-dir", default=None)
    args = p.parse_args(argv)

    import checkpointables as cp
    import jax

    _instrument(args.op)
    tree = cases.get_case(args.case).tree(1.0)
    spec = libraries.tree_spec(tree)
    (safetensors,) = libraries.all_libraries(["safetensors"])
    root = libraries.scratch_dir(args.tmp_dir)
    ours, theirs, phases = [], [], collections.defaultdict(list)
    try:
        if args.op == "load":
            cp.save_pytree(os.path.join(root, "c"), tree)
            safetensors.save(os.path.join(root, "s"), tree, spec)
        for n in range(2 + args.repeats):
            _spent.clear()
            if args.op == "save":
                mine = _clock(lambda n=n: cp.save_pytree(os.path.join(root, f"c{n}"), tree))
                other = _clock(
                    lambda n=n: safetensors.save(os.path.join(root, f"s{n}"), tree, spec)
                )
                shutil.rmtree(os.path.join(root, f"c{n}"))
                shutil.rmtree(os.path.join(root, f"s{n}"))
            else:
                mine = _clock(
                    lambda: jax.block_until_ready(cp.load_pytree(os.path.join(root, "c")))
                )
                other = _clock(lambda: safetensors.load(os.path.join(root, "s"), spec))
            if n >= 2:
                ours.append(mine)
                theirs.append(other)
                for label, seconds in _spent.items():
                    phases[label].append(seconds)
    finally:
        libraries.remove(root)

    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e3:7.1f} ms"

    load = os.getloadavg()[0]
    print(f"{args.case} {args.op}, median of {args.repeats} (load average {load:.2f})")
    print(f"  checkpointables  {ms([w for w, _ in ours])} (CPU {ms([c for _, c in ours])})")
    print(f"  safetensors      {ms([w for w, _ in theirs])} (CPU {ms([c for _, c in theirs])})")
    for label in sorted(phases):
        indent = "    " + "  " * label.split()[0].count(".")
        print(f"{indent}{label:<50s} {ms(phases[label])}")


if __name__ == "__main__":
    main()
