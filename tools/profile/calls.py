"""How much Python one request runs through a gateway: calls and profiled time per request.

A deterministic census, not a sampler (``profile_serve.py`` samples): for each ``--targets``
entry (``kvgate``, ``kvgate-<policy>``, ``kvgate@<checkout>`` or a Python floor of
``loadtest/peers/targets.py``) one simulated replica (compute ~0) and the target in front of
it, started as ``kvgate bench peers --overhead`` starts them (kvgate's probes slowed down).
After a warm-up, SIGUSR1 starts ``cProfile`` inside the target (``calls_hook/sitecustomize.py``
on its PYTHONPATH), exactly ``--requests`` requests go through it one at a time, SIGUSR2
stops the profile and writes it. Every count is then divided by the requests: Python
function calls and calls into C (``dict.get``, ``bytes.lower``, a socket write) per request,
by module and by function, with cProfile's own time per request beside them.

The counts do not depend on the machine's load; the times do, and cProfile inflates every
call (its own cost is per call), so read them as shares. ``kvgate`` minus
``python-floor`` (the same server and client with no request work) is what kvgate's
own request work runs.

    python tools/profile/calls.py --targets kvgate,python-floor --requests 2000
    python tools/profile/calls.py --targets kvgate --requests 500 --kb 400 --stream
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import signal
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rich.console import Console
from rich.table import Table

from loadtest.bench_gateway import (
    PROFILE,
    client_session,
    large_body,
    small_body,
    timed_post,
    with_stream,
)
from loadtest.peers.overhead import SLOW_PROBES
from loadtest.peers.run import PEERS
from loadtest.peers.targets import open_target
from loadtest.simulator.fleet import SimFleet

HOOK = Path(__file__).resolve().parent / "calls_hook"
PATH = "/v1/chat/completions"
Key = tuple[str, int, str]  # pstats: (file, line, function)


async def drive(url: str, body: bytes, n: int) -> None:
    async with client_session(1) as session:
        for _ in range(n):
            await timed_post(session, url + PATH, body)


def profiled(pid: int, url: str, body: bytes, n: int, out: Path, warmup: int) -> pstats.Stats:
    """``n`` requests through the target while its profile runs (after ``warmup`` unprofiled ones)."""
    recorded(pid, url, body, n, out, warmup)
    return pstats.Stats(str(out))


def recorded(pid: int, url: str, body: bytes, n: int, out: Path, warmup: int) -> None:
    """``warmup`` requests, then ``n`` between SIGUSR1 and SIGUSR2 (a hook in the target
    records them), then the wait for the hook to write ``out`` (whole: it renames)."""
    asyncio.run(drive(url, body, warmup))
    os.kill(pid, signal.SIGUSR1)
    time.sleep(0.2)  # the handler runs at the target's next bytecode: let it start before the first request
    asyncio.run(drive(url, body, n))
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + 30.0
    while not out.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the target (pid {pid}) wrote nothing to {out} (its hook failed? see its log)")
        time.sleep(0.05)


def where(key: Key) -> str:
    """A function's module, short: ``gateway/proxy.py``, ``uvicorn/.../httptools_impl.py``, ``C``."""
    path = key[0]
    if path == "~":
        return "C"
    for marker in ("/site-packages/", "/lib/python3"):
        if marker in path:
            rest = path.split(marker, 1)[1]
            return rest.split("/", 1)[1] if marker == "/lib/python3" and "/" in rest else rest
    return os.path.relpath(path, ROOT) if path.startswith(str(ROOT)) else path


PerRequest = dict[str, float]


def census(stats: pstats.Stats, n: int) -> tuple[PerRequest, PerRequest, PerRequest, PerRequest]:
    """(calls by module, us by module, calls by function, us by function), per request. A call
    into C counts under ``C`` and, for the function table, under its name."""
    calls: PerRequest = defaultdict(float)
    spent: PerRequest = defaultdict(float)
    fcalls: PerRequest = defaultdict(float)
    fspent: PerRequest = defaultdict(float)
    for key, (_, ncalls, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        module = where(key)
        name = key[2] if module == "C" else f"{key[2]} ({module}:{key[1]})"
        calls[module] += ncalls / n
        spent[module] += tottime / n * 1e6
        fcalls[name] += ncalls / n
        fspent[name] += tottime / n * 1e6
    return calls, spent, fcalls, fspent


def table(title: str, calls: PerRequest, spent: PerRequest, top: int) -> Table:
    t = Table(title=title)
    t.add_column("calls/request", justify="right")
    t.add_column("profiled us/request", justify="right")
    t.add_column("where")
    for name, c in sorted(calls.items(), key=lambda kv: -spent[kv[0]])[:top]:
        if c >= 0.5:
            t.add_row(f"{c:.1f}", f"{spent[name]:.1f}", name)
    return t


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="kvgate,python-floor")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--kb", type=int, default=0, help="an agent-shaped body of this size (0: a small chat)")
    parser.add_argument("--stream", action="store_true", help="streamed answers (8 tokens)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", type=Path, default=None, help="write the census here")
    args = parser.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if peers := [t for t in targets if t in PEERS]:  # (SIGUSR1 would end a process without the hook)
        parser.error(f"not a Python gateway: {', '.join(peers)}; the census runs inside kvgate and the floors")
    console = Console()
    body = small_body() if args.kb == 0 else large_body(args.kb)
    body = with_stream(body, args.stream, 8 if args.stream else 1)
    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-calls-"))
    totals: dict[str, tuple[float, float, float]] = {}
    modules: dict[str, dict[str, tuple[float, float]]] = {}
    functions: dict[str, dict[str, tuple[float, float]]] = {}
    with SimFleet(1, profile=PROFILE, time_scale=1e6, seed=1, log_dir=log_dir) as fleet:
        # only the targets started from here on load the hook (the replica above does not)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HOOK), os.environ.get("PYTHONPATH")]))
        for target in targets:
            out = log_dir / f"{target.replace('/', '_')}.prof"
            os.environ["KVGATE_CALLS_OUT"] = str(out)
            with open_target(target, fleet.urls, log_dir, SLOW_PROBES) as (url, pid):
                stats = profiled(pid, url, body, args.requests, out, args.warmup)
            calls, spent, fcalls, fspent = census(stats, args.requests)
            python = sum(c for m, c in calls.items() if m != "C")
            totals[target] = (python, calls.get("C", 0.0), sum(spent.values()))
            modules[target] = {m: (round(c, 2), round(spent[m], 2)) for m, c in calls.items() if c >= 0.5}
            functions[target] = {f: (round(c, 2), round(fspent[f], 2)) for f, c in fcalls.items() if c >= 0.5}
            console.print(table(f"{target}: by module", calls, spent, args.top))
            console.print(table(f"{target}: by function", fcalls, fspent, args.top))
    summary = Table(title=f"per request ({args.requests} requests, {'stream' if args.stream else 'whole'} "
                          f"answers, body {len(body):,} B)")
    for column in ("target", "Python calls", "calls into C", "profiled us"):
        summary.add_column(column, justify="right" if column != "target" else "left")
    for target, (python, c, us) in totals.items():
        summary.add_row(target, f"{python:.0f}", f"{c:.0f}", f"{us:.0f}")
    console.print(summary)
    if args.json is not None:
        args.json.write_text(json.dumps({
            "requests": args.requests, "stream": args.stream, "body_bytes": len(body),
            "targets": {t: {"python_calls": round(p, 1), "c_calls": round(c, 1), "profiled_us": round(us, 1),
                            "modules": modules[t], "functions": functions[t]}
                        for t, (p, c, us) in totals.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
