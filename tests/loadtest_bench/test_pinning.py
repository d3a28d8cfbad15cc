"""loadtest/peers/pinning.py: the overhead bench's ``--pin-routers`` (real processes and threads)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest.peers.overhead import Options
from loadtest.peers.pinning import on_cpus, pin_threads, split_cpus

# a process with two extra threads and a child process, all waiting
SPAWNER = """
import subprocess, sys, threading, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
for _ in range(2):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print(child.pid, flush=True)
time.sleep(60)
"""


def _allowed(pid: int) -> list[str]:
    return [Path(f"/proc/{pid}/task/{tid}/status").read_text().split("Cpus_allowed_list:")[1].split()[0]
            for tid in os.listdir(f"/proc/{pid}/task")]


def test_every_thread_and_child_of_a_router_is_pinned() -> None:
    cpu = min(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, "-c", SPAWNER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{proc.pid}/task")) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pin_threads(proc.pid, {cpu}) >= 4  # the main thread, two threads, the child
        assert set(_allowed(proc.pid)) == {str(cpu)} and set(_allowed(child)) == {str(cpu)}
    finally:
        proc.kill()
        proc.wait()


def test_the_bench_thread_runs_on_the_other_cpus_and_gets_its_own_back() -> None:
    before = os.sched_getaffinity(0)
    if len(before) < 2:  # one CPU: there is nothing to split, and the bench says so
        with pytest.raises(ValueError, match="leaves no CPU"):
            split_cpus([max(before)])
        return
    routers, rest = split_cpus([max(before)])
    assert routers == {max(before)} and rest == before - routers
    with on_cpus(rest):
        assert os.sched_getaffinity(0) == rest
    assert os.sched_getaffinity(0) == before


def test_a_split_that_leaves_nothing_or_names_a_missing_cpu_is_refused() -> None:
    available = sorted(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="leaves no CPU"):
        split_cpus(available)
    with pytest.raises(ValueError, match="not among"):
        split_cpus([max(available) + 1000])


def test_the_option_is_parsed_from_the_flag() -> None:
    from argparse import Namespace
    assert Options.from_args(Namespace(pin_routers="1")).pin_routers == (1,)
    assert Options.from_args(Namespace()).pin_routers == ()
