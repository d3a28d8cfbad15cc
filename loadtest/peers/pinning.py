"""CPU pinning for the overhead bench (``--pin-routers``): the routers on their own CPUs, the
bench's client and the simulated replica on the rest.

On a small machine (2 vCPUs here) everything of a round competes for the same cores: the
router's work after it writes an answer (its bookkeeping) runs while the client reads that
answer and the replica finishes its own request, three processes on two CPUs, and shows in
the router's measured latency (docs/profile.md, "The callbacks path, built"). A router on
a production host has cores of its own; pinning gives it one here, so the bench can tell
what a router costs from how it competes with the client. Every router gets the same
CPUs, so the comparison between routers stays fair.

Linux only (``os.sched_setaffinity``). A process's affinity is per thread: ``pin_threads``
pins every thread a running process has, and threads it starts later inherit their
creator's. A child process inherits the affinity of the thread that starts it, so the
bench pins its own (main) thread to the other CPUs before it starts the replica and the
routers, then moves each router's threads to the router CPUs once it runs.
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


def split_cpus(router_cpus: Sequence[int]) -> tuple[set[int], set[int]]:
    """(the routers' CPUs, the rest) out of this process's CPUs; ValueError when the routers
    would get a CPU this process may not use, or leave none for the client and replica."""
    available = os.sched_getaffinity(0)
    routers = set(router_cpus)
    if not routers or not routers <= available:
        raise ValueError(f"--pin-routers {sorted(routers)}: not among this process's CPUs {sorted(available)}")
    rest = available - routers
    if not rest:
        raise ValueError(f"--pin-routers {sorted(routers)} leaves no CPU for the client and the replica")
    return routers, rest


def pin_threads(pid: int, cpus: set[int]) -> int:
    """Every thread of process ``pid`` and of its descendants onto ``cpus``; how many were
    pinned (a thread or process that ends meanwhile is skipped)."""
    pinned = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return 0
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cpus)
            pinned += 1
        except ProcessLookupError:
            continue
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children = f.read().split()
        except FileNotFoundError:
            continue
        pinned += sum(pin_threads(int(child), cpus) for child in children)
    return pinned


@contextmanager
def on_cpus(cpus: set[int]) -> Iterator[None]:
    """The calling thread (and the processes it starts meanwhile) on ``cpus``; restored after."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
