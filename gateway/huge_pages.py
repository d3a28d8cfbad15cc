"""`kvgate serve` with glibc's malloc on transparent huge pages.

Between two requests the other processes of a gateway's host (and, in the overhead bench,
the client, the replica and the other routers) evict the gateway's memory from the CPU's
caches and its page translations from the TLB, so each step of a request's path costs
2.5-5x what it costs in a warm loop (docs/profile.md). In a VM a TLB miss walks two levels
of page tables. With glibc's ``glibc.malloc.hugetlb=1`` tunable, the memory glibc's
malloc takes from the kernel is ``madvise(MADV_HUGEPAGE)``d: the interpreter's larger
objects (dict tables, lists, code objects, request bodies) sit on 2 MB pages, and one TLB
entry covers what 512 did. Measured in three interleaved runs: -0.01 ms of added latency
on a small request at p50, ~0.02 ms less CPU per request (docs/benchmarks.md, "Held
requests and huge pages").

The tunable is read when a process starts, so ``kvgate serve`` started as a program
executes itself again, once, with it added to ``GLIBC_TUNABLES`` (same pid, same
arguments, nothing opened yet). Not when it cannot apply: not Linux with glibc,
transparent huge pages ``never``, or the tunable already set (an operator's own value is
kept). ``KVGATE_HUGE_PAGES=0`` turns it off. (A process-level switch outside the settings
object: it acts before the settings are loaded.)
"""
from __future__ import annotations

import logging
import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("kvgate.serve")
TUNABLE = "glibc.malloc.hugetlb"
SWITCH = "KVGATE_HUGE_PAGES"
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), None if unknown."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def tunables_with_huge_pages(environ: Mapping[str, str], system: str, libc: str, mode: str | None) -> str | None:
    """The ``GLIBC_TUNABLES`` value to run with, or None to run as started."""
    if environ.get(SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if system != "Linux" or libc != "glibc" or mode not in ("always", "madvise"):
        return None
    current = environ.get("GLIBC_TUNABLES", "")
    if TUNABLE in current:
        return None
    return f"{current}:{TUNABLE}=1" if current else f"{TUNABLE}=1"


def reexec_with_huge_pages() -> None:
    """Execute this program again with the tunable (see the module's docstring); returns
    only when it does not apply or the exec fails."""
    tunables = tunables_with_huge_pages(os.environ, platform.system(), platform.libc_ver()[0], thp_mode())
    if tunables is None:
        return
    env = {**os.environ, "GLIBC_TUNABLES": tunables}
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError as exc:  # (the program as started still works)
        log.warning("cannot restart with huge pages for malloc (%s); running without", exc)
