"""`kvgate bench peers --overhead`: the latency and CPU each router adds, side by side, one run.

Method (``loadtest.bench_gateway.measure_interleaved``): every target runs at once in
front of one simulated replica (``kimi-k2.6-b200-tp8`` profile at ``--replica-time-scale``,
default 1e6: compute is ~0 and a 400 KB prompt fits its context; at 5 a stream's tokens
are paced as on a fleet, one SSE chunk per read); keep-alive connections; each
round sends ``c`` concurrent requests straight to the replica, then ``c`` through the
first router, then ``c`` direct again and ``c`` through the second, and so on, so a
drift of the machine hits every router and its direct samples alike; a router's CPU
(user + system from ``/proc/<pid>/stat``) is counted around its own rounds only (a
router idle during the others' rounds spends only its probes, slowed for kvgate).
Interleaved, each router also runs colder (its process waits while the others' rounds
run), which costs an interpreter more than compiled code: ``--sequential`` measures the
targets one after the other, for comparison (as before 2026-12-02, except that every
target is started first and the others sit idle, probing, while one is measured). Cases:
a small chat body and
``--kbs`` KB agent-shaped ones (default 100 and 400), non-streaming (``max_tokens = 1``,
time to the end of the body) and streaming (``max_tokens = --stream-tokens``, 8: time to the first body
byte and to the end), at each ``--concurrency`` (default 1 and 32).

Added latency at p50, p90, p99 and p99.9 = router percentile - direct percentile, with a
paired percentile-bootstrap interval (``loadtest.bootstrap``: 95%, 1,000 resamples,
seeded); every figure states its sample count, and one with fewer than 10 samples beyond
it (p99.9 below 10,000 samples) is flagged "unsupported".

``--max-rate``: the highest Poisson arrival rate (open loop) at which one router process
keeps its added p99 on ``--max-rate-kb`` KB bodies within ``--max-rate-p99-ms``: a
step-up search from ``--max-rate-start`` by x``--max-rate-step``, ``--max-rate-s``
seconds (and at least ``--max-rate-n`` requests, 1,000: a supported p99) per side and step, direct first, stopping at the first step over the limit (or
stepping down while the first rate is already over it).

``--pin-routers CPUS``: every router's threads on those CPUs, the bench's client and the
replica on the others (``loadtest/peers/pinning.py``): a router then competes with no other
process of the bench, as on a host of its own.

The machine is shared and noisy: compare the targets of one run with each other, not with
another run's absolute numbers.  Standalone: ``python -m loadtest.peers.overhead``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from rich.console import Console
from rich.table import Table

from loadtest.bench_gateway import (
    PROFILE,
    Samples,
    large_body,
    measure_interleaved,
    open_loop,
    small_body,
    with_stream,
)
from loadtest.bench_simulator import process_cpu_s
from loadtest.bootstrap import bootstrap_differences
from loadtest.peers.pinning import on_cpus, pin_threads, split_cpus
from loadtest.peers.targets import kvgate_policy, open_target, target_version
from loadtest.percentile import percentile
from loadtest.simulator.fleet import SimFleet

QS = (50.0, 90.0, 99.0, 99.9)
UNSUPPORTED = "* unsupported: fewer than 10 samples beyond the percentile (loadtest.percentile.supported)"
SLOW_PROBES = ("--set", "registry.probe_interval_s=60", "--set", "registry.loads_poll_interval_s=60")


@dataclasses.dataclass(frozen=True)
class Options:
    small: int = 2000
    large: int = 2000
    kbs: tuple[int, ...] = (100, 400)
    concurrency: tuple[int, ...] = (1, 32)
    resamples: int = 1000
    confidence: float = 0.95
    seed: int = 0
    max_rate: bool = False
    max_rate_kb: int = 400
    max_rate_start: float = 20.0
    max_rate_step: float = 1.5
    max_rate_s: float = 20.0
    max_rate_n: int = 1000  # samples per side and step at least: a supported p99
    max_rate_steps: int = 12
    max_rate_p99_ms: float = 10.0
    stream_tokens: int = 8  # output tokens of a streamed case (the replica sends several an SSE event)
    replica_time_scale: float = 1e6  # the replica's compute ~0; e.g. 5: a stream paced as on a fleet
    sequential: bool = False  # the targets' cases one target after the other (the others idle)
    pin_routers: tuple[int, ...] = ()  # CPUs for the routers (the client and replica on the rest); () none

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Options:
        """From this module's flags, or `bench peers`' (``--small/--large/--kb`` only)."""
        d = cls()
        kbs = getattr(args, "kbs", None) or ",".join(str(k) for k in dict.fromkeys((100, getattr(args, "kb", 400))))
        values = {f.name: getattr(args, f.name, getattr(d, f.name)) for f in dataclasses.fields(cls)}
        values["kbs"] = _ints(kbs)
        values["concurrency"] = _ints(str(getattr(args, "concurrency", "1,32")))
        values["pin_routers"] = _ints(str(getattr(args, "pin_routers", None) or ""))
        return cls(**values)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in text.split(",") if t.strip())


@dataclasses.dataclass(frozen=True)
class Case:
    body: str
    kb: float
    stream: bool
    concurrency: int
    n: int


def cases(opts: Options) -> list[tuple[Case, bytes]]:
    sizes = [("small", small_body(), opts.small)] + [(f"{k}KB", large_body(k), opts.large) for k in opts.kbs]
    sizes = [size for size in sizes if size[2] > 0]  # 0 samples: that size is not measured
    out: list[tuple[Case, bytes]] = []
    for c in opts.concurrency:
        for name, body, n in sizes:
            for stream in (False, True):
                b = with_stream(body, stream, opts.stream_tokens if stream else 1)
                out.append((Case(name, len(b) / 1000, stream, c, n), b))
    return out


def case_rows(head: dict[str, Any], case: Case, s: Samples, opts: Options) -> list[dict[str, Any]]:
    """One row per metric: end of body (always) and first body byte (streaming)."""
    metrics = [("end", s.via_total, s.direct_total)]
    if case.stream:
        metrics.insert(0, ("first byte", s.via_ttfb, s.direct_ttfb))
    rows = []
    for metric, via, direct in metrics:
        added = bootstrap_differences(via, direct, QS, opts.resamples, opts.confidence, opts.seed)
        rows.append({**head, **dataclasses.asdict(case), "metric": metric, "n": s.requests,
                     "direct_p50_ms": (percentile(direct, 50) or 0.0) * 1e3,
                     "added_ms": {f"p{q:g}": e.scaled(1e3).as_dict() for q, e in zip(QS, added, strict=True)},
                     "cpu_ms_per_request": s.cpu_s / s.requests * 1e3,
                     "load_avg_1m": os.getloadavg()[0]})  # the machine is shared: read figures beside it
    return rows


async def _rate_step(replica: str, url: str, pid: int, body: bytes, rate: float, seed: int,
                     opts: Options) -> dict[str, Any]:
    """One step: ``rate``/s straight to the replica, then through the router."""
    n = max(int(rate * opts.max_rate_s), opts.max_rate_n)
    try:
        direct, direct_kept_up = await open_loop(replica, body, rate, n, seed)
        cpu0 = process_cpu_s(pid)
        via, via_kept_up = await open_loop(url, body, rate, n, seed)
        cpu = process_cpu_s(pid) - cpu0
    except (TimeoutError, RuntimeError, OSError, aiohttp.ClientError) as e:
        return {"rate": rate, "n": n, "within_limit": False, "error": str(e)}
    (p99,) = bootstrap_differences(via, direct, (99.0,), opts.resamples, opts.confidence, opts.seed)
    kept_up = min(direct_kept_up, via_kept_up)
    return {"rate": rate, "n": n, "client_kept_up": kept_up, "added_p99_ms": p99.scaled(1e3).as_dict(),
            "cpu_ms_per_request": cpu / n * 1e3,
            "within_limit": p99.value * 1e3 <= opts.max_rate_p99_ms and kept_up >= 0.9}


async def max_rate(replica: str, url: str, pid: int, opts: Options, console: Console) -> dict[str, Any]:
    """Step-up search for the highest open-loop rate within the added-p99 limit (stepping
    down instead while even the first rate is over it)."""
    body = large_body(opts.max_rate_kb)
    steps: list[dict[str, Any]] = []
    rate, best, down = opts.max_rate_start, 0.0, False
    for i in range(opts.max_rate_steps):
        step = await _rate_step(replica, url, pid, body, rate, opts.seed + i, opts)
        steps.append(step)
        p99 = step.get("added_p99_ms", {}).get("value", float("nan"))
        console.print(f"  max-rate {rate:.1f}/s: added p99 {p99:+.2f} ms (n={step['n']}) "
                      f"{'ok' if step['within_limit'] else step.get('error', 'over the limit')}")
        if step["within_limit"]:
            best = rate
            if down:
                break
            rate *= opts.max_rate_step
        elif best > 0 or "error" in step or rate / opts.max_rate_step < 1.0:
            break
        else:
            down, rate = True, rate / opts.max_rate_step
    return {"kb": opts.max_rate_kb, "p99_limit_ms": opts.max_rate_p99_ms, "sustained_rate": best,
            "steps": steps}


MEASURE_ERRORS = (RuntimeError, TimeoutError, OSError, aiohttp.ClientError)  # a target failing mid-measure


def _head(target: str) -> dict[str, Any]:
    return {"target": target, "version": target_version(target)}


async def measured_rows(
    opened: Sequence[tuple[str, str, int]], replica: str, opts: Options, console: Console
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every case with the ``opened`` targets' rounds interleaved, then each one's
    ``--max-rate`` search in turn; a failure ends that part with an error row."""
    heads = [_head(target) for target, _, _ in opened]  # one per opened target, repeated names too
    rows: list[dict[str, Any]] = []
    rates: list[dict[str, Any]] = []
    gateways = [(url, pid) for _, url, pid in opened]
    try:
        for case, body in cases(opts):
            console.print(f"overhead: {', '.join(h['target'] for h in heads)}, {case.body} stream={case.stream} "
                          f"c={case.concurrency} x {case.n}")
            samples = await measure_interleaved(replica, gateways, body, case.n, case.concurrency, opts.seed)
            for head, s in zip(heads, samples, strict=True):
                rows.extend(case_rows(head, case, s, opts))
    except MEASURE_ERRORS as e:
        console.print(f"[red]overhead failed: {e}[/]")
        rows.extend({**head, "error": str(e)} for head in heads)
    if opts.max_rate:
        for head, (target, url, pid) in zip(heads, opened, strict=True):
            try:
                rates.append({**head, **await max_rate(replica, url, pid, opts, console)})
            except MEASURE_ERRORS as e:
                console.print(f"[red]{target} max rate failed: {e}[/]")
                rows.append({**head, "error": f"max rate: {e}"})
    return rows, rates


def overhead_rows(
    targets: Sequence[str], opts: Options, log_dir: Path, console: Console
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    routers_cpus: set[int] | None = None
    with ExitStack() as stack:
        if opts.pin_routers:  # (pinning: this thread and what it starts on the other CPUs)
            routers_cpus, rest = split_cpus(opts.pin_routers)
            stack.enter_context(on_cpus(rest))
            console.print(f"pinned: routers on CPU {sorted(routers_cpus)}, the bench's client and the replica on "
                          f"{sorted(rest)}")
        fleet = stack.enter_context(SimFleet(1, profile=PROFILE, time_scale=opts.replica_time_scale, seed=1,
                                                  log_dir=log_dir))
        replica = fleet.urls[0]
        opened: list[tuple[str, str, int]] = []
        for target in targets:
            extra = SLOW_PROBES if kvgate_policy(target) is not None else ()
            try:
                url, pid = stack.enter_context(open_target(target, [replica], log_dir, extra))
            except (RuntimeError, TimeoutError, OSError) as e:
                console.print(f"[red]{target} failed to start: {e}[/]")
                rows.append({**_head(target), "error": str(e)})
                continue
            if routers_cpus is not None:
                pin_threads(pid, routers_cpus)
            opened.append((target, url, pid))
        rates: list[dict[str, Any]] = []
        groups = [[o] for o in opened] if opts.sequential else [opened] if opened else []
        for group in groups:
            measured, rated = asyncio.run(measured_rows(group, replica, opts, console))
            rows.extend(measured)
            rates.extend(rated)
    return rows, rates


def _cell(e: dict[str, Any]) -> str:
    """``+1.23 [+1.10,+1.40]``; a leading ``*`` marks it unsupported (too few samples beyond it)."""
    text = f"{e['value']:+.2f} [{e['lo']:+.2f},{e['hi']:+.2f}]"
    return text if e["supported"] else f"[dim]*{text}[/]"


def overhead_table(rows: Sequence[dict[str, Any]]) -> Table:
    table = Table(title="added latency (ms, router - direct, [95% bootstrap interval]) and router CPU "
                  "per request; one replica, compute ~0", title_justify="left",
                  caption=UNSUPPORTED, caption_justify="left")
    cols = ("target", "body", "stream", "c", "metric", "n", "direct p50", *(f"added p{q:g}" for q in QS),
            "CPU/request", "load")
    for col in cols:
        table.add_column(col, justify="left" if col in ("target", "body", "metric") else "right",
                         overflow="fold")
    for row in rows:
        if "error" in row:
            table.add_row(str(row["version"]), f"failed: {row['error']}"[:60])
            continue
        added = row["added_ms"]
        table.add_row(str(row["version"]), str(row["body"]), "yes" if row["stream"] else "no",
                      str(row["concurrency"]), str(row["metric"]), str(row["n"]),
                      f"{row['direct_p50_ms']:.2f}", *(_cell(added[f"p{q:g}"]) for q in QS),
                      f"{row['cpu_ms_per_request']:.2f} ms", f"{row.get('load_avg_1m', float('nan')):.1f}")
    return table


def max_rate_table(rates: Sequence[dict[str, Any]]) -> Table:
    table = Table(title="highest open-loop rate one router process sustains (added p99 within the "
                  "limit)", title_justify="left", caption=UNSUPPORTED, caption_justify="left")
    for col in ("target", "body", "limit", "sustained", "last step", "added p99 there", "n", "CPU/request"):
        table.add_column(col, justify="left" if col == "target" else "right")
    for r in rates:
        last = r["steps"][-1] if r["steps"] else {}
        p99 = last.get("added_p99_ms")
        table.add_row(str(r["version"]), f"{r['kb']} KB", f"{r['p99_limit_ms']:g} ms",
                      f"{r['sustained_rate']:.1f}/s", f"{last.get('rate', 0.0):.1f}/s",
                      _cell(p99) if p99 else str(last.get("error", "-"))[:40], str(last.get("n", "-")),
                      f"{last['cpu_ms_per_request']:.2f} ms" if "cpu_ms_per_request" in last else "-")
    return table


def run_overhead(args: argparse.Namespace, targets: Sequence[str], console: Console) -> int:
    opts = Options.from_args(args)
    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-bench-overhead-"))
    rows, rates = overhead_rows(targets, opts, log_dir, console)
    console.print(overhead_table(rows))
    if rates:
        console.print(max_rate_table(rates))
    if args.json:
        doc = {"options": dataclasses.asdict(opts), "overhead": rows, "max_rate": rates}
        args.json.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
        console.print(f"results: {args.json}")
    return 0 if all("error" not in r for r in rows) else 1


def add_overhead_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    d = Options()
    parser.add_argument("--small", type=int, default=d.small, help="small requests per side and case (0: none)")
    parser.add_argument("--large", type=int, default=d.large, help="large requests per side and case (0: none)")
    parser.add_argument("--kbs", default="100,400", help="large body sizes (KB), comma-separated")
    parser.add_argument("--concurrency", default="1,32", help="requests in flight per round, comma-separated")
    parser.add_argument("--resamples", type=int, default=d.resamples, help="bootstrap resamples")
    parser.add_argument("--confidence", type=float, default=d.confidence, help="bootstrap interval level")
    parser.add_argument("--max-rate", action="store_true", help="also search the highest sustained rate")
    parser.add_argument("--max-rate-kb", type=int, default=d.max_rate_kb)
    parser.add_argument("--max-rate-start", type=float, default=d.max_rate_start, help="first rate (req/s)")
    parser.add_argument("--max-rate-step", type=float, default=d.max_rate_step, help="rate factor per step")
    parser.add_argument("--max-rate-s", type=float, default=d.max_rate_s, help="seconds per side and step")
    parser.add_argument("--max-rate-n", type=int, default=d.max_rate_n, help="samples per side and step, at least")
    parser.add_argument("--max-rate-steps", type=int, default=d.max_rate_steps)
    parser.add_argument("--max-rate-p99-ms", type=float, default=d.max_rate_p99_ms)
    parser.add_argument("--stream-tokens", type=int, default=d.stream_tokens,
                        help="output tokens per streamed request (the simulated replica sends several an SSE event "
                             "when paced): the per-chunk relay cost")
    parser.add_argument("--replica-time-scale", type=float, default=d.replica_time_scale,
                        help="the simulated replica's time scale (default 1e6: compute ~0, a short stream "
                             "arrives in a few reads; 5: tokens paced at a fifth of decode time, one SSE "
                             "chunk per read, as on a live fleet)")
    parser.add_argument("--sequential", action="store_true",
                        help="measure the targets one after the other (all started; only the measured one gets "
                             "requests) instead of interleaving their rounds")
    parser.add_argument("--pin-routers", default="", metavar="CPUS",
                        help="CPUs (comma-separated) every router is pinned to; the bench's client and the replica "
                             "run on the others (loadtest/peers/pinning.py); default: no pinning")


def main(argv: Sequence[str] | None = None) -> int:
    from loadtest.peers.targets import check_peers, parse_targets

    parser = argparse.ArgumentParser(prog="python -m loadtest.peers.overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default="kvgate,sglang-router,smg")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, metavar="OUT")
    add_overhead_arguments(parser)
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 200))  # the table is wide
    targets = parse_targets(args.targets)
    if not check_peers(targets, False, console):
        return 2
    return run_overhead(args, targets, console)


if __name__ == "__main__":
    raise SystemExit(main())
