"""`kvgate bench polls`: what a large fleet's probes and load polls cost the gateway, in
batches (``registry.poll_batch``, default 16) against every replica at once (0).

Method: one real simulated replica answers each path the gateway calls once
(``loadtest.stub_fleet.capture``); one stub process replays those answers on
``--replicas`` loopback ports, so the gateways see N replica URLs. Two ``kvgate serve``
processes stand in front of all N with the default poll intervals (loads every 1 s,
readiness every 2 s): one spreads its polls in batches (``--batch``), one polls every
replica at once (``poll_batch=0``). Once every replica is routable in both:

1. each gateway's idle CPU (``/proc/<pid>/stat``) over ``--idle-s``;
2. small chat requests at concurrency 1, interleaved (``measure_interleaved``: straight to
   one stub port, then through each gateway in turn), ``--n`` per gateway: added latency
   at p50, p90, p99, p99.9 and the maximum, with bootstrap intervals, and CPU per request.

A request that lands while the gateway's event loop runs a burst of N GETs waits for it:
that is the tail this measures. Both gateways poll the same stub process at once, so
neither is measured alone; they are compared in one run.

    kvgate bench polls --replicas 512 --n 3000 --json out.json
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from loadtest.bench_gateway import PROFILE, Samples, measure_interleaved, small_body
from loadtest.bench_simulator import process_cpu_s
from loadtest.bootstrap import bootstrap_differences
from loadtest.demo import GatewayProcess
from loadtest.simulator.fleet import SimFleet
from loadtest.stub_fleet import capture, running

QS = (50.0, 90.0, 99.0, 99.9)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=512, help="replica URLs (ports of the stub process)")
    parser.add_argument("--batch", type=int, default=16, help="registry.poll_batch of the spreading gateway")
    parser.add_argument("--n", type=int, default=3000, help="small requests per gateway")
    parser.add_argument("--idle-s", type=float, default=20.0, help="seconds of idle CPU measured per gateway")
    parser.add_argument("--join-timeout-s", type=float, default=120.0, help="for every replica to be routable")
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")


def wait_routable(url: str, n: int, timeout_s: float) -> float:
    """Seconds until the gateway's ``/ready`` counts ``n`` routable replicas."""
    start = time.monotonic()
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while time.monotonic() - start < timeout_s:
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url + "/ready").json().get("routable_replicas") == n:
                    return time.monotonic() - start
            time.sleep(0.5)
    raise TimeoutError(f"{url}: not all {n} replicas routable after {timeout_s:g} s")


def idle_cpu_ms_per_s(pid: int, seconds: float) -> float:
    before, start = process_cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    return (process_cpu_s(pid) - before) / (time.monotonic() - start) * 1e3


def rows(names: Sequence[str], samples: Sequence[Samples], idle: Sequence[float],
         resamples: int) -> list[dict[str, Any]]:
    out = []
    for name, s, cpu in zip(names, samples, idle, strict=True):
        added = bootstrap_differences(s.via_total, s.direct_total, QS, resamples)
        out.append({"gateway": name, "n": s.requests, "idle_cpu_ms_per_s": cpu,
                    "cpu_ms_per_request": s.cpu_s / s.requests * 1e3,
                    "added_ms": {f"p{q:g}": e.scaled(1e3).as_dict() for q, e in zip(QS, added, strict=True)},
                    "added_max_ms": (max(s.via_total) - max(s.direct_total)) * 1e3,
                    "via_max_ms": max(s.via_total) * 1e3, "direct_max_ms": max(s.direct_total) * 1e3})
    return out


def table(found: Sequence[dict[str, Any]], replicas: int) -> Table:
    t = Table(title=f"kvgate in front of {replicas} replica URLs: polls in batches vs all at once")
    for col in ("gateway", "n", "idle CPU", "added p50", "p90", "p99", "p99.9", "max via / direct", "CPU/request"):
        t.add_column(col, justify="left" if col == "gateway" else "right")
    for r in found:
        a = r["added_ms"]
        cells = [f"{a[k]['value']:+.2f} [{a[k]['lo']:+.2f},{a[k]['hi']:+.2f}]" for k in ("p50", "p90", "p99", "p99.9")]
        t.add_row(r["gateway"], str(r["n"]), f"{r['idle_cpu_ms_per_s']:.1f} ms/s", *cells,
                  f"{r['via_max_ms']:.1f} / {r['direct_max_ms']:.1f} ms", f"{r['cpu_ms_per_request']:.2f} ms")
    return t


def run(args: argparse.Namespace) -> int:
    console = Console()
    work = Path(tempfile.mkdtemp(prefix="kvgate-bench-polls-"))
    body = small_body()
    console.print(f"capturing one simulated replica's answers (logs: {work})")
    with SimFleet(1, profile=PROFILE, time_scale=1e6, seed=1, log_dir=work) as sim:
        answers = capture(sim.urls[0], body)
    modes = [(f"batches of {args.batch}", str(args.batch)), ("all at once", "0")]
    with running(answers, args.replicas, work) as (urls, _stub_pid), contextlib.ExitStack() as stack:
        gateways = []
        for name, batch in modes:
            gw = stack.enter_context(GatewayProcess("cache-aware", urls, ["--set", f"registry.poll_batch={batch}"],
                                                    ready_timeout_s=args.join_timeout_s, log_dir=work))
            assert gw.proc is not None
            gateways.append((gw.url, gw.proc.pid))
            console.print(f"{name}: {args.replicas} replicas routable after "
                          f"{wait_routable(gw.url, args.replicas, args.join_timeout_s):.1f} s")
        idle = []
        for (name, _), (_, pid) in zip(modes, gateways, strict=True):
            idle.append(idle_cpu_ms_per_s(pid, args.idle_s))
            console.print(f"{name}: idle {idle[-1]:.1f} ms of CPU a second")
        console.print(f"{args.n} small requests per gateway, interleaved with direct ones")
        samples = asyncio.run(measure_interleaved(urls[0], gateways, body, args.n, 1))
    found = rows([name for name, _ in modes], samples, idle, args.resamples)
    console.print(table(found, args.replicas))
    console.print(f"command: kvgate bench polls {' '.join(sys.argv[1:])}; load average "
                  f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json is not None:
        args.json.write_text(json.dumps({"options": {k: str(v) for k, v in vars(args).items()}, "rows": found},
                                        indent=1))
        console.print(f"results: {args.json}")
    return 0
