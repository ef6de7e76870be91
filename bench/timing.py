"""Timing one case: every library saves and loads the same tree, interleaved per repeat.

Interleaving (repeat 1: raw, checkpointables, orbax, safetensors; repeat 2:
...) spreads slow drifts of the machine (page cache, other load) over all
libraries instead of charging them to whichever ran last. Each save goes to
a fresh path under the scratch directory; the load reads it straight back
from the page cache (caches are never dropped); then it is deleted.

Before each timed call the harness touches and frees ``warm_bytes`` of
memory (see ``warm_free_memory``). On this VM, memory that stays free for a
couple of seconds is handed back to the host, and touching it again costs up
to 3 s per GiB: without the warming, whichever call happened to allocate
after a pause paid for it, and the 1 GiB loads varied 0.3 s to 2.4 s.

Then it hands the memory that glibc's malloc keeps free back to the kernel
(``release_malloc_cache``), so that no call reuses, without page faults,
what the call before it freed: otherwise the raw 256 MiB load took 36 ms
right after Orbax and safetensors had freed hundreds of MiB and 110 ms after
anything else, and the ratios to raw depended on which library ran last.
Every timed call now allocates fresh pages, as a load into a new process
does. ``--keep-malloc-cache`` turns this off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import gc
import os
import statistics
import time
import traceback
from typing import Any

import numpy as np

from bench import libraries
from bench.cases import Case


@dataclasses.dataclass
class LibraryTimes:
    """Seconds per repeat for one library on one case."""

    save_s: list[float] = dataclasses.field(default_factory=list)
    load_s: list[float] = dataclasses.field(default_factory=list)
    async_block_s: list[float] = dataclasses.field(default_factory=list)
    async_total_s: list[float] = dataclasses.field(default_factory=list)
    verified: bool = False
    error: str | None = None

    def median(self, field: str) -> float | None:
        """The median of ``field`` (e.g. ``"save_s"``), ``None`` when nothing was measured."""
        values = getattr(self, field)
        return statistics.median(values) if values and self.error is None else None


PAGE = 4096


def warm_free_memory(nbytes: int) -> None:
    """Touches ``nbytes`` of fresh memory and frees it, so the next allocations are cheap.

    The freed pages go back to the kernel's free lists backed by real host
    memory; a call that starts right away reuses them instead of faulting in
    pages the hypervisor reclaimed. Untimed; every library gets the same.
    """
    if nbytes < PAGE:
        return
    buffer = np.empty(nbytes, np.uint8)
    buffer[::PAGE] = 1
    del buffer


def release_malloc_cache() -> None:
    """Hands the memory glibc's malloc holds free back to the kernel (``malloc_trim(0)``).

    Without it, whichever library runs after one that freed a lot of heap
    memory allocates from that memory without a single page fault, while the
    others fault in fresh pages: the raw 256 MiB load took 36 ms after Orbax
    and safetensors had run and 110 ms otherwise, in one run. Does nothing
    where glibc is not the allocator.
    """
    if _libc is not None:
        _libc.malloc_trim(0)


def _load_libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only.
    except (OSError, AttributeError):
        return None
    return libc


_libc = _load_libc()


def _prepare_memory(warm_bytes: int, release_malloc: bool) -> None:
    gc.collect()
    warm_free_memory(warm_bytes)
    if release_malloc:
        release_malloc_cache()


def _clock(
    fn: Any, *args: Any, warm_bytes: int = 0, release_malloc: bool = True
) -> tuple[float, Any]:
    _prepare_memory(warm_bytes, release_malloc)
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def _one_round(
    library: libraries.Library,
    case: Case,
    tree: Any,
    spec: libraries.TreeSpec,
    root: str,
    tag: str,
    times: LibraryTimes | None,
    warm_bytes: int,
    release_malloc: bool,
) -> None:
    path = os.path.join(root, f"{library.name}-{tag}")
    memory = {"warm_bytes": warm_bytes, "release_malloc": release_malloc}
    try:
        save_s, _ = _clock(library.save, path, tree, spec, **memory)
        load_s, loaded = _clock(library.load, path, spec, **memory)
        if not times or not times.verified:
            libraries.verify(library, loaded, spec, tree)
        del loaded
    finally:
        libraries.remove(path)
    block_s = total_s = None
    if case.measure_async and library.has_async:
        try:
            _prepare_memory(warm_bytes, release_malloc)
            start = time.perf_counter()
            pending = library.save_async(path + "-async", tree, spec)
            block_s = time.perf_counter() - start
            pending.result()
            total_s = time.perf_counter() - start
        finally:
            libraries.remove(path + "-async")
    if times is not None:
        times.verified = True
        times.save_s.append(save_s)
        times.load_s.append(load_s)
        if block_s is not None:
            times.async_block_s.append(block_s)
            times.async_total_s.append(total_s)


def time_case(
    case: Case,
    tree: Any,
    libs: list[libraries.Library],
    *,
    repeats: int,
    warmup: int,
    root: str,
    warm_bytes: int = 0,
    release_malloc: bool = True,
    progress: Any = print,
) -> dict[str, LibraryTimes]:
    """Times save, load (and async save) of ``tree`` for every library; never raises.

    A library that fails gets its error recorded and is skipped for the rest
    of the case. The first round (warm-up or not) also checks the loaded
    values against ``tree``. Before each timed call, ``warm_bytes`` goes to
    ``warm_free_memory`` and, if ``release_malloc``, ``release_malloc_cache``
    runs, so that every call starts with the same (empty) malloc cache.
    """
    spec = libraries.tree_spec(tree)
    results = {lib.name: LibraryTimes() for lib in libs}
    for round_no in range(warmup + repeats):
        warm = round_no < warmup
        for lib in libs:
            result = results[lib.name]
            if result.error is not None:
                continue
            try:
                _one_round(
                    lib,
                    case,
                    tree,
                    spec,
                    root,
                    str(round_no),
                    None if warm else result,
                    warm_bytes,
                    release_malloc,
                )
                if warm:
                    result.verified = True
            except Exception as e:
                result.error = f"{type(e).__name__}: {e}"
                progress(f"  {lib.name}: FAILED: {result.error}")
                progress(traceback.format_exc(limit=4))
        if not warm:
            progress(repeat_line(results, round_no - warmup + 1, repeats))
    return results


def repeat_line(results: dict[str, LibraryTimes], number: int, repeats: int) -> str:
    """The progress line of timed repeat ``number``: each library's last save/load times."""
    line = ", ".join(
        f"{name} {r.save_s[-1]:.3f}/{r.load_s[-1]:.3f}"
        for name, r in results.items()
        if r.error is None and r.save_s
    )
    return f"  repeat {number}/{repeats} save/load s: {line}"
