"""Imports flow one way: gateway -> policies -> {prefix_index, replicas}.

Parses every module's imports (no execution) and checks the package rules of
docs/design.md; the serving path never imports the load-test harness or the simulator.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = {"gateway", "policies", "prefix_index", "replicas", "loadtest"}
ALLOWED: dict[str, set[str]] = {
    "prefix_index": set(),
    "replicas": {"prefix_index"},
    "policies": {"prefix_index", "replicas"},
    "gateway": {"policies", "prefix_index", "replicas"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & PROJECT


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_flow_one_way(package: str) -> None:
    bad: list[str] = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for imported in _imports(path) - {package} - ALLOWED[package]:
            bad.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert not bad, "\n".join(bad)


def test_cli_loads_subcommands_lazily() -> None:
    """gateway/cli.py names subcommand modules as strings; it imports none at module level."""
    assert _imports(ROOT / "gateway" / "cli.py") == set()


def _module_graph() -> dict[str, set[str]]:
    """Project module -> project modules it imports (any import: top level, in a function,
    under TYPE_CHECKING; a name imported from a package counts as its submodule when one
    exists)."""
    modules: dict[str, Path] = {}
    for package in sorted(PROJECT):
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    if sub in modules:
                        graph[name].add(sub)
                    elif node.module in modules:
                        graph[name].add(node.module)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in modules)
        graph[name].discard(name)
    return graph


def test_module_graph_is_acyclic() -> None:
    """No import cycles in the house (a cycle hides a missing seam: a god object, a split file)."""
    graph = _module_graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_class_names_are_unique() -> None:
    """One name per thing: no two top-level classes of the project share a name."""
    seen: dict[str, list[str]] = {}
    for package in sorted(PROJECT):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.parse(path.read_text(), filename=str(path)).body:
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    seen.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    twice = {name: where for name, where in seen.items() if len(where) > 1}
    assert not twice, twice
