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
