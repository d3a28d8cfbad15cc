"""The serving packages use libraries through their public APIs only (issue 40).

Parses every module of ``gateway/``, ``policies/``, ``prefix_index/`` and ``replicas/``
(no execution) and refuses:

- an import of a library's private module (a dotted segment starting with ``_``, e.g.
  ``uvicorn._types``, ``aiohttp._http_parser``) or of an HTTP server's or client's
  internals (``uvicorn.protocols``, ``uvicorn.server``, ``uvicorn.supervisors``, ...);
- an HTTP parser: kvgate never frames or parses HTTP itself (``httptools``, ``h11``);
- a class deriving from a server's or client's classes (``uvicorn``, ``aiohttp``,
  ``httpx``, ``granian``, ``asyncio.Protocol``), but for documented extension points
  (``httpx.Auth``);
- an assignment to a private attribute (``x._name = ...``) of anything but ``self`` or
  ``cls``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVING = ("gateway", "policies", "prefix_index", "replicas")
PROJECT = {*SERVING, "loadtest", "tests"}
HTTP_PARSERS = {"httptools", "h11", "llhttp"}
SERVER_INTERNALS = ("uvicorn.protocols", "uvicorn.server", "uvicorn.supervisors", "uvicorn.config",
                    "uvicorn.lifespan", "uvicorn.loops", "uvicorn.middleware")
NO_SUBCLASS_FROM = {"uvicorn", "aiohttp", "httpx", "granian", "httpcore"}
SUBCLASS_OK = {"httpx.Auth"}  # documented extension points meant to be subclassed


def _modules() -> list[Path]:
    return sorted(p for package in SERVING for p in (ROOT / package).rglob("*.py"))


def _private_module(module: str) -> bool:
    parts = module.split(".")
    return parts[0] not in PROJECT and any(p.startswith("_") and not p.startswith("__") for p in parts)


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    imported_from: dict[str, str] = {}  # local name -> the module it came from
    for node in ast.walk(tree):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
            imported_from.update({(a.asname or a.name).split(".")[0]: a.name for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
            imported_from.update({a.asname or a.name: node.module for a in node.names})
        for module in modules:
            if _private_module(module):
                found.append(f"line {node.lineno}: imports the private module {module}")
            if module.split(".")[0] in HTTP_PARSERS:
                found.append(f"line {node.lineno}: imports the HTTP parser {module}")
            if module.startswith(SERVER_INTERNALS):
                found.append(f"line {node.lineno}: imports the server internals {module}")
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                name = ast.unparse(base)
                origin = imported_from.get(name.split(".")[0], "")
                full = f"{origin}.{name.split('.', 1)[1]}" if "." in name else f"{origin}.{name}"
                if full in SUBCLASS_OK or name in SUBCLASS_OK:
                    continue
                if origin.split(".")[0] in NO_SUBCLASS_FROM or full.startswith(("asyncio.Protocol",
                                                                                "asyncio.protocols")) \
                        or name in ("asyncio.Protocol", "asyncio.BufferedProtocol"):
                    found.append(f"line {node.lineno}: class {node.name} derives from {name} ({origin})")
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr.startswith("_") \
                        and not target.attr.startswith("__") \
                        and not (isinstance(target.value, ast.Name) and target.value.id in ("self", "cls")):
                    found.append(f"line {node.lineno}: writes the private attribute {ast.unparse(target)}")
    return found


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_serving_modules_use_public_apis_only(path: Path) -> None:
    assert not _violations(path), "\n".join(_violations(path))


def test_the_checker_catches_what_it_refuses(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import httptools\n"
        "from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol\n"
        "from uvicorn._types import HTTPScope\n"
        "import asyncio\n"
        "class P(HttpToolsProtocol): pass\n"
        "class Q(asyncio.Protocol): pass\n"
        "def f(fut):\n"
        "    fut._asyncio_future_blocking = False\n")
    found = "\n".join(_violations(bad))
    for expected in ("HTTP parser httptools", "server internals uvicorn.protocols", "private module uvicorn._types",
                     "class P derives", "class Q derives", "private attribute fut._asyncio_future_blocking"):
        assert expected in found, found
