"""The shape of the code: no import cycle inside a distribution, no function over 60 lines,
and the pytree plugin's rooms importing one another one way only, through public names.

All read the source with the standard library's ``ast`` (nothing is imported).
An import cycle means two modules can only be understood together; a long
function, that a reader cannot hold it at once. Fold, split or move code until
these pass; never raise the limit.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Each distribution's source root.
SOURCES = {
    "core": ROOT / "core" / "src",
    **{p.name: p / "src" for p in sorted((ROOT / "plugins").iterdir()) if (p / "src").is_dir()},
    "example_plugin": ROOT / "tests" / "example_plugin" / "src",
}
MAX_FUNCTION_LINES = 60
PYTREE = "checkpointables_pytree"
# The pytree plugin's rooms (subpackages along the data's path) and the rooms each may
# import. The package's top modules (the handler, the plans, partial saves, verify) may
# import every room; no room imports a top module. See plugins/pytree/README.md.
PYTREE_ROOMS: dict[str, set[str]] = {
    "tree": set(),
    "zarr3": set(),
    "storage": set(),
    "ocdbt": {"storage", "zarr3"},
    "io": {"ocdbt", "storage", "zarr3"},
    "leaves": {"io", "ocdbt", "storage", "tree", "zarr3"},
    "reuse": {"io", "ocdbt", "storage", "tree", "zarr3"},
}
# Internals patched by tests where their callers look them up (a counter, a range size).
PRIVATE_IMPORTS_ALLOWED = {
    "tests/integration/object_store/test_ranged_reads.py": {f"{PYTREE}.io._remote_reads"},
    "tests/plugins/pytree/io/test_small_reads.py": {f"{PYTREE}.io._small_reads"},
    "bench/phases.py": {f"{PYTREE}.ocdbt._database_writer", f"{PYTREE}.tree._metadata_file"},
}


def _modules(source: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under ``source``."""
    modules = {}
    for path in source.rglob("*.py"):
        parts = list(path.relative_to(source).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the same distribution that ``module`` imports (anywhere in its body)."""
    found = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:  # A submodule.
                    found.add(f"{target}.{alias.name}")
                elif target in modules:  # A name defined in the module.
                    found.add(target)
    return found - {module}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = [stack.pop()]
            while component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


@pytest.mark.parametrize("distribution", sorted(SOURCES))
def test_no_import_cycle(distribution: str) -> None:
    modules = _modules(SOURCES[distribution])
    graph = {m: _imported(m, p, modules) for m, p in modules.items()}
    assert _cycles(graph) == []


def test_the_benchmark_has_no_import_cycle() -> None:
    # bench/ is a package at the repository root, run with ``python -m bench.<tool>``.
    modules = {".".join(filter(None, ("bench", m))): p for m, p in _modules(ROOT / "bench").items()}
    graph = {m: _imported(m, p, modules) for m, p in modules.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("distribution", sorted(SOURCES))
def test_no_function_is_longer_than_the_limit(distribution: str) -> None:
    long = []
    for module, path in sorted(_modules(SOURCES[distribution]).items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{module}.{node.name} ({path.name}:{node.lineno}): {lines} lines")
    assert long == []


def _room(module: str) -> str | None:
    """The pytree room of ``module`` ("" for the package's top modules, None outside)."""
    parts = module.split(".")
    if parts[0] != PYTREE:
        return None
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in PYTREE_ROOMS) else ""


def _room_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports between rooms that go against ``PYTREE_ROOMS`` or reach a private module."""
    found = []
    for module, imported in sorted(graph.items()):
        here = _room(module)
        for other in sorted(imported):
            there = _room(other)
            if there is None or there == here:
                continue
            if here != "" and there not in PYTREE_ROOMS[here]:
                found.append(
                    f"{module} imports {other}: {here or 'top'} may not import {there or 'top'}"
                )
            elif there != "" and other != f"{PYTREE}.{there}":
                found.append(f"{module} imports {other}: import the room's public names instead")
    return found


def test_pytree_rooms_import_one_way_through_public_names() -> None:
    modules = _modules(SOURCES["pytree"])
    graph = {m: _imported(m, p, modules) for m, p in modules.items()}
    assert {_room(m) for m in modules} == {"", *PYTREE_ROOMS}
    assert _room_violations(graph) == []


def test_the_room_checker_finds_wrong_ways_and_private_reaches() -> None:
    graph = {
        f"{PYTREE}.ocdbt._index": {f"{PYTREE}.leaves", f"{PYTREE}.storage"},
        f"{PYTREE}.io._reader": {f"{PYTREE}.ocdbt._index", f"{PYTREE}._handler"},
        f"{PYTREE}._handler": {f"{PYTREE}.io._reader", f"{PYTREE}.leaves"},
    }
    public = "import the room's public names instead"
    assert _room_violations(graph) == [
        f"{PYTREE}._handler imports {PYTREE}.io._reader: {public}",
        f"{PYTREE}.io._reader imports {PYTREE}._handler: io may not import top",
        f"{PYTREE}.io._reader imports {PYTREE}.ocdbt._index: {public}",
        f"{PYTREE}.ocdbt._index imports {PYTREE}.leaves: ocdbt may not import leaves",
    ]


@pytest.mark.parametrize("room", sorted(PYTREE_ROOMS))
def test_each_room_says_its_job_and_what_it_offers(room: str) -> None:
    init = SOURCES["pytree"] / PYTREE / room / "__init__.py"
    module = ast.parse(init.read_text())
    assert len(ast.get_docstring(module) or "") > 200, f"{room}/__init__.py: say the room's job"
    offered = [
        ast.literal_eval(node.value)
        for node in module.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__"
    ]
    assert offered and all(not name.startswith("_") for name in offered[0]), offered


def test_tests_and_bench_use_the_rooms_public_names() -> None:
    reaching = []
    for path in sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]):
        where = str(path.relative_to(ROOT))
        allowed = PRIVATE_IMPORTS_ALLOWED.get(where, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PYTREE):
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module or ""]
                private = {t for t in targets if any(p.startswith("_") for p in t.split(".")[1:])}
                private -= {t for t in private if _room(t) == "" and t.count(".") == 1}
                reaching += [f"{where}: {t}" for t in sorted(private - allowed)]
    assert reaching == []


def _strings(tree: ast.AST) -> list[ast.Constant]:
    """The string constants of a module, docstrings left out (prose may name anything)."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


def test_core_names_no_file_of_the_pytree_plugin() -> None:
    """Core asks the pytree handler (``cp.protocols.Recognizing``) whether a directory holds a
    pytree; the plugin's files (``_METADATA``, ``ocdbt.*`` folders) are the plugin's business."""
    plugin_file = re.compile(r"(?<![A-Z_])_METADATA\b|ocdbt")
    found = []
    for module, path in sorted(_modules(SOURCES["core"]).items()):
        for node in _strings(ast.parse(path.read_text())):
            if plugin_file.search(node.value):
                found.append(f"{module} ({path.name}:{node.lineno}): {node.value!r}")
    assert found == []
