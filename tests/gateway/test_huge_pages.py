"""`kvgate serve` runs with the interpreter's memory on transparent huge pages (gateway/huge_pages.py):
the rule for when it applies, and a real `kvgate serve` process's environment and memory."""
from __future__ import annotations

import platform
from pathlib import Path

import pytest

from gateway.huge_pages import (
    SWITCH,
    TUNABLE,
    environment_with_huge_pages,
    thp_mode,
    tunables_with_huge_pages,
)
from tests.integration.conftest import start_gateway

ON = f"{TUNABLE}=1"


def test_the_tunable_is_added_where_it_applies() -> None:
    assert tunables_with_huge_pages({}, "Linux", "glibc", "madvise") == ON
    assert tunables_with_huge_pages({}, "Linux", "glibc", "always") == ON
    # an operator's other tunables are kept, theirs for this one too
    assert tunables_with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "Linux", "glibc",
                                    "madvise") == f"glibc.malloc.arena_max=2:{ON}"
    assert tunables_with_huge_pages({"GLIBC_TUNABLES": f"{TUNABLE}=0"}, "Linux", "glibc", "madvise") is None


def test_python_objects_come_from_malloc_unless_the_operator_chose() -> None:
    env = environment_with_huge_pages({"HOME": "/h"}, "Linux", "glibc", "madvise")
    assert env == {"HOME": "/h", "GLIBC_TUNABLES": ON, "PYTHONMALLOC": "malloc"}
    env = environment_with_huge_pages({"PYTHONMALLOC": "pymalloc_debug"}, "Linux", "glibc", "madvise")
    assert env is not None and env["PYTHONMALLOC"] == "pymalloc_debug"
    assert environment_with_huge_pages({SWITCH: "0"}, "Linux", "glibc", "madvise") is None


@pytest.mark.parametrize(("environ", "system", "libc", "mode"), [
    ({SWITCH: "0"}, "Linux", "glibc", "madvise"),
    ({SWITCH: "off"}, "Linux", "glibc", "madvise"),
    ({}, "Darwin", "", "madvise"),
    ({}, "Linux", "", "madvise"),  # musl: no such tunable
    ({}, "Linux", "glibc", "never"),
    ({}, "Linux", "glibc", None),  # no transparent huge pages in this kernel
])
def test_not_where_it_cannot_apply_or_is_turned_off(environ: dict[str, str], system: str, libc: str,
                                                     mode: str | None) -> None:
    assert tunables_with_huge_pages(environ, system, libc, mode) is None


def test_the_kernel_mode_is_the_bracketed_one(tmp_path: Path) -> None:
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert thp_mode(path) == "madvise"
    path.write_text("[always] madvise never\n")
    assert thp_mode(path) == "always"
    assert thp_mode(tmp_path / "missing") is None


def _environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)


def _anon_huge_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


applies = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc" and thp_mode() in ("always", "madvise")


@pytest.mark.skipif(not applies, reason="needs Linux, glibc and transparent huge pages (always or madvise)")
def test_a_gateway_process_runs_with_huge_pages_unless_turned_off(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv(SWITCH, raising=False)
    monkeypatch.delenv("PYTHONMALLOC", raising=False)
    gw = start_gateway([], tmp_path / "on.log")
    try:
        pid = gw.proc.popen.pid  # (the same process: it executed itself again)
        assert ON in _environ(pid).get("GLIBC_TUNABLES", "") and _environ(pid).get("PYTHONMALLOC") == "malloc"
        assert _anon_huge_kb(pid) > 0, "no transparent huge page in the gateway's memory"
    finally:
        gw.proc.stop()
    monkeypatch.setenv(SWITCH, "0")
    gw = start_gateway([], tmp_path / "off.log")
    try:
        pid = gw.proc.popen.pid
        assert TUNABLE not in _environ(pid).get("GLIBC_TUNABLES", "") and "PYTHONMALLOC" not in _environ(pid)
        if thp_mode() == "madvise":  # (with "always" the kernel gives them to every process)
            assert _anon_huge_kb(pid) == 0
    finally:
        gw.proc.stop()
