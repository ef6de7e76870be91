"""Renders a results JSON file as the Markdown of ``docs/performance.md``'s results section.

uv run python -m bench.markdown bench/results/bench-<time>.json > /tmp/results.md
"""

from __future__ import annotations

import json
import sys
from typing import Any

from bench import report
from bench.timing import LibraryTimes

_FIELDS = ("save_s", "load_s", "async_block_s", "async_total_s", "verified", "error")


def _times(case: dict[str, Any]) -> dict[str, LibraryTimes]:
    return {
        name: LibraryTimes(**{f: entry[f] for f in _FIELDS})
        for name, entry in case["libraries"].items()
    }


def _spread(times: dict[str, LibraryTimes]) -> str:
    parts = []
    for name, t in times.items():
        if t.error is None and t.save_s:
            parts.append(
                f"{name} save {min(t.save_s):.3g}-{max(t.save_s):.3g} s, "
                f"load {min(t.load_s):.3g}-{max(t.load_s):.3g} s"
            )
    return "; ".join(parts)


def render(document: dict[str, Any]) -> str:
    """The Markdown: settings, machine, targets, then one table per case and memory."""
    m, s = document["machine"], document["settings"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
    out = [
        f"Run `{document['command']}` at {document['started']} (commit {m['git_commit']}): "
        f"{s['repeats']} timed repeats after {s['warmup']} warm-up, scale {s['scale']:g}, "
        + (
            "malloc's free memory released before each timed call."
            if s.get("release_malloc_cache")
            else "malloc's free memory kept between calls (`--keep-malloc-cache`)."
        ),
        "",
        f"Machine: {m['nproc']} CPUs ({m['cpu']}), {m['memory_gib']} GiB RAM, Linux "
        f"{m['kernel']}, checkpoints on {m['filesystem']}; Python {m['python']}; {versions}. "
        f"Load average when the run started: {m.get('load_average_1min', '?')}.",
        "",
    ]
    if document.get("unavailable"):
        out += [f"Not measured: {document['unavailable']}", ""]
    if document.get("targets"):
        out += ["### Targets of issue 3", "", report.targets_table(document["targets"]), ""]
    for name, case in document["cases"].items():
        if "libraries" not in case:  # Cases with tables of their own (incremental, interop).
            continue
        times = _times(case)
        out += [
            f"### `{name}`: {case['title']}",
            "",
            f"{case['leaves']} leaves, {case['bytes'] / 2**20:.2f} MiB. Medians:",
            "",
            report.case_table(times),
            "",
            f"Range over the repeats: {_spread(times)}.",
            "",
        ]
        if case.get("memory"):
            out += [
                "Peak RSS growth (fresh process per row):",
                "",
                report.memory_table(case["memory"]),
                "",
            ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Prints the Markdown for the JSON file named on the command line."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(args[0]) as f:
        print(render(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
