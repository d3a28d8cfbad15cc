"""`kvgate serve` with the interpreter's memory on transparent huge pages.

Between two requests the other processes of a gateway's host (and, in the overhead bench,
the client, the replica and the other routers) evict the gateway's memory from the CPU's
caches and its page translations from the TLB, so each step of a request's path costs
2.5-5x what it costs in a warm loop (docs/profile.md). In a VM a TLB miss walks two levels
of page tables. So the gateway runs with:

- glibc's ``glibc.malloc.hugetlb=1`` tunable: the memory glibc's malloc takes from the
  kernel is ``madvise(MADV_HUGEPAGE)``d, so it sits on 2 MB pages (one TLB entry covers
  what 512 did);
- ``PYTHONMALLOC=malloc``: every Python object from glibc's malloc, so on those pages
  (CPython's own small-object allocator maps 1 MB arenas of 4 KB pages, which the tunable
  does not reach).

Measured, interleaved, 2,000 small requests a run (docs/benchmarks.md, "Held requests and
huge pages"): the tunable alone -0.01 ms of added latency at p50 in three runs; with
``PYTHONMALLOC=malloc`` as well, another -0.005 to -0.018 ms in two runs, and less CPU per
request.

Both are read when a process starts, so ``kvgate serve`` started as a program executes
itself again, once, with them in its environment (same pid, same arguments, nothing
opened yet). Not when the pages cannot be had: not Linux with glibc, transparent huge
pages ``never``, or the tunable already set (an operator's own value is kept; so is their
own ``PYTHONMALLOC``). ``KVGATE_HUGE_PAGES=0`` turns it off. (A process-level switch
outside the settings object: it acts before the settings are loaded.)
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


def environment_with_huge_pages(environ: Mapping[str, str], system: str, libc: str,
                                mode: str | None) -> dict[str, str] | None:
    """The environment to run with (the tunable added, ``PYTHONMALLOC=malloc`` unless
    set), or None to run as started."""
    tunables = tunables_with_huge_pages(environ, system, libc, mode)
    if tunables is None:
        return None
    return {"PYTHONMALLOC": "malloc", **environ, "GLIBC_TUNABLES": tunables}


def reexec_with_huge_pages() -> None:
    """Execute this program again with huge pages (see the module's docstring); returns
    only when they do not apply or the exec fails."""
    env = environment_with_huge_pages(os.environ, platform.system(), platform.libc_ver()[0], thp_mode())
    if env is None:
        return
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError as exc:  # (the program as started still works)
        log.warning("cannot restart with huge pages for malloc (%s); running without", exc)
