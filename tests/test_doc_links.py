"""Every relative link in the project's Markdown points at a file that exists, and every
``#anchor`` at a heading of its target (GitHub's slugs). External links are not fetched."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = {".git", "build", "node_modules", ".venv", ".venv-peers", ".venv-tools", ".pytest_cache"}
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def _docs() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.md")
                  if not SKIP & set(p.relative_to(ROOT).parts) and not p.parts[-2].startswith(".venv"))


def _slug(heading: str) -> str:
    text = re.sub(r"[`*_]|<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _broken(path: Path) -> list[str]:
    bad = []
    for m in LINK.finditer(FENCE.sub("", path.read_text())):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor}")
    return bad


@pytest.mark.parametrize("path", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    bad = _broken(path)
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# Title here\n")
    a = tmp_path / "a.md"
    a.write_text("[ok](b.md#title-here) [gone](c.md) [anchor](b.md#nope) [web](https://x.invalid)\n"
                 "```\n[in a fence](nowhere.md)\n```\n")
    assert _broken(a) == ["c.md: no such file", "b.md#nope: no heading #nope"]
