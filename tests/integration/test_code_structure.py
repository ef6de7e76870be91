"""The shape of the code: no import cycle inside a distribution, no function over 60 lines,
no module of the pytree plugin over 400.

All read the source with the standard library's ``ast`` (nothing is imported).
An import cycle means two modules can only be understood together; a long
function, that a reader cannot hold it at once. Fold, split or move code until
these pass; never raise the limit.
"""

from __future__ import annotations

import ast
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
# Modules of the pytree plugin stay short enough to read in one sitting (issue 19).
MAX_MODULE_LINES = {"pytree": 400}


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


@pytest.mark.parametrize("distribution", sorted(MAX_MODULE_LINES))
def test_no_module_is_longer_than_the_limit(distribution: str) -> None:
    limit = MAX_MODULE_LINES[distribution]
    long = [
        f"{path.name}: {n} lines"
        for path in sorted(SOURCES[distribution].rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > limit
    ]
    assert long == []
