"""Ratios, the issue's targets with pass/fail, the printed tables and the JSON file."""

from __future__ import annotations

import dataclasses
import json
import operator
import os
from collections.abc import Callable, Mapping
from typing import Any

from bench.timing import LibraryTimes

SUBJECT = "checkpointables"
PEER = "orbax"
BASELINE = "raw"
FORMAT_PEER = "safetensors"

_COMPARE: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    "<": operator.lt,
    ">=": operator.ge,
}


@dataclasses.dataclass(frozen=True)
class Target:
    """One requirement of issue 3: ``metric`` of checkpointables on ``case`` ``op`` ``limit``."""

    case: str
    metric: str
    op: str
    limit: float
    text: str


TARGETS: tuple[Target, ...] = (
    Target("1gib", "save_vs_raw", "<=", 1.2, "durable save <= 1.2x raw write+fsync"),
    Target("1gib", "load_vs_raw", "<=", 1.5, "load <= 1.5x raw read (page cache)"),
    Target("1gib", "async_block_fraction", "<", 0.10, "async save returns in < 10% of sync save"),
    Target("1gib", "mem_save", "<=", 0.25, "peak RSS growth, sync save <= 0.25x size"),
    Target("1gib", "mem_save_async", "<=", 1.1, "peak RSS growth, async save <= 1.1x size"),
    Target("1gib", "mem_load", "<=", 1.2, "peak RSS growth, load <= 1.2x size"),
    Target("256mib", "save_vs_raw", "<=", 1.3, "save <= 1.3x raw"),
    Target("256mib", "load_vs_raw", "<=", 2.0, "load <= 2x raw"),
    Target("small-numpy", "save_speedup_vs_orbax", ">=", 10, "save >= 10x faster than Orbax"),
    Target("small-numpy", "load_speedup_vs_orbax", ">=", 10, "load >= 10x faster than Orbax"),
    Target("small-jax", "save_speedup_vs_orbax", ">=", 10, "save >= 10x faster than Orbax"),
    Target("small-jax", "load_speedup_vs_orbax", ">=", 10, "load >= 10x faster than Orbax"),
    # Issue 19: the middle size, and memory on many small arrays.
    Target("128mib-128kib", "save_vs_raw", "<=", 1.5, "save <= 1.5x raw"),
    Target("small-numpy", "mem_save", "<=", 1.5, "peak RSS growth, sync save <= 1.5x size"),
    # Issue 21: many small arrays at safetensors' speed, and the training loop's stall.
    Target("small-numpy", "save_vs_safetensors", "<=", 1.5, "save <= 1.5x safetensors + fsync"),
    Target("small-numpy", "load_vs_safetensors", "<=", 2.0, "load <= 2x safetensors load_file"),
    Target("small-jax", "async_block_s", "<=", 0.020, "async save returns in <= 20 ms"),
    Target("tiny-numpy", "save_speedup_vs_orbax", ">=", 5, "save >= 5x faster than Orbax"),
    Target("tiny-numpy", "load_speedup_vs_orbax", ">=", 5, "load >= 5x faster than Orbax"),
    Target("tiny-jax", "save_speedup_vs_orbax", ">=", 5, "save >= 5x faster than Orbax"),
    Target("tiny-jax", "load_speedup_vs_orbax", ">=", 5, "load >= 5x faster than Orbax"),
)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def metrics_for(
    library: str,
    times: Mapping[str, LibraryTimes],
    memory: Mapping[str, Mapping[str, Any]] | None,
) -> dict[str, float | None]:
    """Every metric a target can name, for ``library`` on one case (``None`` = not measured)."""
    mine = times.get(library)
    raw, peer, fmt = times.get(BASELINE), times.get(PEER), times.get(FORMAT_PEER)

    def med(t: LibraryTimes | None, field: str) -> float | None:
        return None if t is None else t.median(field)

    out: dict[str, float | None] = {
        "save_vs_raw": _ratio(med(mine, "save_s"), med(raw, "save_s")),
        "load_vs_raw": _ratio(med(mine, "load_s"), med(raw, "load_s")),
        "save_speedup_vs_orbax": _ratio(med(peer, "save_s"), med(mine, "save_s")),
        "load_speedup_vs_orbax": _ratio(med(peer, "load_s"), med(mine, "load_s")),
        "save_vs_safetensors": _ratio(med(mine, "save_s"), med(fmt, "save_s")),
        "load_vs_safetensors": _ratio(med(mine, "load_s"), med(fmt, "load_s")),
        "async_block_fraction": _ratio(med(mine, "async_block_s"), med(mine, "save_s")),
        "async_block_s": med(mine, "async_block_s"),
    }
    for op in ("save", "save_async", "load"):
        entry = (memory or {}).get(library, {}).get(op)
        out[f"mem_{op}"] = entry.get("fraction") if entry and "fraction" in entry else None
    return out


def evaluate(
    results: Mapping[str, Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """Each target with checkpointables' and Orbax's values and a verdict.

    Verdicts: ``PASS``/``FAIL``, or ``n/a`` when the case or library did not run.
    """
    rows = []
    for target in TARGETS:
        case = results.get(target.case)
        if case is None:
            continue
        values = {
            lib: metrics_for(lib, case["times"], case.get("memory"))[target.metric]
            for lib in (SUBJECT, PEER)
        }
        if target.metric.endswith("_vs_orbax"):
            values[PEER] = None  # Orbax against itself says nothing.
        mine = values[SUBJECT]
        verdict = (
            "n/a"
            if mine is None
            else ("PASS" if _COMPARE[target.op](mine, target.limit) else "FAIL")
        )
        rows.append(
            {
                **dataclasses.asdict(target),
                "value": mine,
                "orbax_value": values[PEER],
                "verdict": verdict,
            }
        )
    return rows


def target_row(
    case: str, metric: str, op: str, limit: float, value: float | None, text: str
) -> dict[str, Any]:
    """A target of a case that runs no Orbax (``op``: ``"<="`` or ``">="``), with its
    verdict: ``n/a`` when ``value`` is None."""
    verdict = "n/a" if value is None else ("PASS" if _COMPARE[op](value, limit) else "FAIL")
    return {
        "case": case,
        "metric": metric,
        "op": op,
        "limit": limit,
        "text": text,
        "value": value,
        "orbax_value": None,
        "verdict": verdict,
    }


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"
    if unit == "%":
        return f"{value * 100:.1f}%"
    return f"{value:.2f}x"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def case_table(times: Mapping[str, LibraryTimes]) -> str:
    """Median save and load times per library, with ratios to raw and speedups over Orbax."""
    raw, peer = times.get(BASELINE), times.get(PEER)
    rows = []
    for name, t in times.items():
        if t.error is not None:
            rows.append([name, "error", t.error[:70], "", "", "", "", ""])
            continue
        save, load = t.median("save_s"), t.median("load_s")
        block = t.median("async_block_s")
        rows.append(
            [
                name,
                _fmt(save, "s"),
                _fmt(load, "s"),
                _fmt(_ratio(save, raw and raw.median("save_s"))),
                _fmt(_ratio(load, raw and raw.median("load_s"))),
                _fmt(_ratio(peer and peer.median("save_s"), save)),
                _fmt(_ratio(peer and peer.median("load_s"), load)),
                "-" if block is None else f"{_fmt(block, 's')} ({_fmt(_ratio(block, save), '%')})",
            ]
        )
    header = [
        "library",
        "save",
        "load",
        "save/raw",
        "load/raw",
        "save: orbax/this",
        "load: orbax/this",
        "async blocks",
    ]
    return _table(header, rows)


def memory_table(memory: Mapping[str, Mapping[str, Any]]) -> str:
    """Peak RSS growth per library and operation, in GiB and as a fraction of the size."""
    rows = []
    for lib, ops in memory.items():
        for op, m in ops.items():
            if "error" in m:
                rows.append([lib, op, "error", m["error"].splitlines()[-1][:70]])
            else:
                rows.append([lib, op, f"{m['growth'] / 2**30:.3f} GiB", f"{m['fraction']:.2f}x"])
    return _table(["library", "operation", "peak RSS growth", "of checkpoint size"], rows)


def targets_table(rows: list[dict[str, Any]]) -> str:
    """The targets with checkpointables' value, Orbax's value and the verdict."""

    def show(metric: str, v: float | None) -> str:
        if metric == "async_block_s":
            return _fmt(v, "s")
        return _fmt(v, "%") if metric == "async_block_fraction" else _fmt(v)

    body = [
        [
            r["case"],
            r["text"],
            show(r["metric"], r["value"]),
            show(r["metric"], r["orbax_value"]),
            r["verdict"],
        ]
        for r in rows
    ]
    return _table(["case", "target", "checkpointables", "orbax", "verdict"], body)


def write_json(path: str, document: Mapping[str, Any]) -> None:
    """Writes ``document`` as indented JSON, creating the directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(document, f, indent=2, default=_jsonable)
        f.write("\n")


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"not JSON-serializable: {type(value).__name__}")
