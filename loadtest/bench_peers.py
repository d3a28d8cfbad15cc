"""`kvgate bench peers`: kvgate against the peer routers, same workload, same fleet, one run.

    kvgate bench peers --trace ../shared/traces/claude-code --replicas 4 --time-scale 10 \\
        --sessions-concurrent 16,32 --limit-sessions 64 --duration-s 45 \\
        --targets kvgate,kvgate-round-robin,sglang-router,smg --json peers.json --chart peers.png
    kvgate bench peers --overhead      # added latency and CPU per request, every target
    kvgate bench peers --engine sglang-cpu --replicas 2 --trace ../shared/traces/claude-code \\
        --limit-sessions 8 --sessions-concurrent 4 --think-scale 0.05 --max-think-s 2 --duration-s 60

One fleet, started once, serves every target: simulated replicas (`SimFleet`), or with
``--engine sglang-cpu`` real SGLang CPU servers and the workload scaled to the tiny model
(`loadtest.sglang_cpu.harness`; ``--api`` picks the API the driver speaks). For each session
concurrency and each target, in that order: every replica's cache is flushed
(``POST /flush_cache``, retried until the replica is idle, so each target starts cold),
the target starts (kvgate: ``kvgate serve --policy P``; a peer: `loadtest.peers.run`),
L1's closed-loop driver replays the same sessions through it for ``--duration-s`` wall
seconds (and at most ``--max-requests``), then the target stops. Targets: ``kvgate``
(cache-aware), ``kvgate-<policy>`` (any kvgate policy), ``sglang-router``
(0.3.2 cache_aware), ``smg`` (1.13.0 cache_aware), ``smg-least-load``.

What is measured, and how it stays fair:

- client side (the driver): hit rate from ``usage.prompt_tokens_details.cached_tokens``,
  TTFT, output tokens/s per user, throughput per GPU (output tokens / makespan / GPUs);
- replica side (``sglang:num_requests_total``, ``prompt_tokens_total`` and
  ``cached_tokens_total`` of every replica, read before and after each run): requests
  per replica, hence the imbalance (max / mean), for peers too (they send no
  ``x-kvgate-replica``), and the replicas' own hit rate as a cross-check;
- output lengths: the driver sends ``max_tokens`` = the trace's output and
  ``ignore_eos``. The peers re-serialize the body (unknown fields are dropped,
  ``max_tokens`` becomes ``max_completion_tokens``); ``ignore_eos`` is one of the SGLang
  fields they know and keep (checked: 200 of 200 tokens through both, where the
  replica's natural length is 16). The ``out/asked`` column (completion tokens /
  requested) keeps checking it: below 1 would mean a target's requests were shorter,
  and its throughput not comparable token for token.

The peers learn only what they route (sglang-router's approximate tree never hears of
evictions); kvgate also reads ``usage`` (cached-token feedback) from every response.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import httpx
from rich.console import Console

from loadtest import charts, results
from loadtest.bench_simulator import process_cpu_s
from loadtest.cli import build_workload
from loadtest.demo import (
    DEFAULT_PROFILE,
    flush_caches,
    scaled_profile,
    sigterm_as_exit,
)
from loadtest.driver import DriverConfig
from loadtest.peers.overhead import add_overhead_arguments, run_overhead
from loadtest.peers.run import (
    INSTALL_HINT,
    PEERS,
)
from loadtest.peers.summary import peers_table, replica_counters, routing_errors, with_replica_side
from loadtest.peers.targets import (
    check_peers,
    open_target,
    parse_targets,
    target_version,
)
from loadtest.replay_oracle import oracle_hit_rate
from loadtest.report import run_with_progress
from loadtest.results import RunResult, summarize
from loadtest.sglang_cpu.harness import (
    Fleet,
    add_engine_arguments,
    check_engine_args,
    effective_time_scale,
    engine_workload,
    open_fleet,
)
from loadtest.workload import Workload

DEFAULT_TARGETS = "kvgate,kvgate-round-robin,sglang-router,smg"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("workload")
    w.add_argument(
        "--trace",
        action="append",
        default=[],
        metavar="PATH",
        help="trace file or folder (repeatable); none or 'synthetic': the synthetic generator",
    )
    w.add_argument("--format", default=None, help="trace format (default: detect)")
    w.add_argument("--limit-sessions", type=int, default=None, help="use at most N sessions")
    w.add_argument("--synthetic-sessions", type=int, default=64)
    w.add_argument(
        "--synthetic-token-scale",
        type=float,
        default=1.0,
        help="multiply the synthetic token sizes (e.g. 0.02 for the tiny profile)",
    )
    w.add_argument("--seed", type=int, default=0)
    f = parser.add_argument_group("fleet")
    f.add_argument("--replicas", type=int, default=4)
    f.add_argument("--profile", default=DEFAULT_PROFILE)
    f.add_argument("--kv-scale", type=float, default=1.0, help="scale the replicas' KV pools")
    f.add_argument(
        "--time-scale", type=float, default=10.0, help="simulated seconds per wall second"
    )
    f.add_argument("--gpus-per-replica", type=int, default=8)
    add_engine_arguments(f)
    d = parser.add_argument_group("driver (per target and concurrency)")
    d.add_argument(
        "--targets",
        default=DEFAULT_TARGETS,
        help=f"comma-separated: kvgate, kvgate-<policy>, {', '.join(PEERS)}",
    )
    d.add_argument(
        "--sessions-concurrent", default="16", help="comma-separated session concurrencies"
    )
    d.add_argument("--duration-s", type=float, default=45.0, help="wall seconds per run")
    d.add_argument("--warm-up-s", type=float, default=3.0,
                   help="wall seconds of discarded load straight at each replica before the first target (0: none)")
    d.add_argument("--max-requests", type=int, default=None, help="requests per run at most")
    d.add_argument("--max-think-s", type=float, default=30.0, help="cap one think time (target s)")
    d.add_argument("--think-scale", type=float, default=1.0)
    d.add_argument("--ramp-s", type=float, default=0.0, help="spread the first sessions (target s)")
    d.add_argument(
        "--grace-s", type=float, default=10.0, help="wall s for in-flight requests at the end"
    )
    d.add_argument(
        "--gateway-arg", action="append", default=[], help="extra `kvgate serve` argument"
    )
    o = parser.add_argument_group("output")
    o.add_argument("--json", type=Path, default=None, metavar="OUT")
    o.add_argument("--chart", type=Path, default=None, metavar="OUT.png")
    o.add_argument(
        "--install", action="store_true", help=f"run `{INSTALL_HINT}` when a peer is missing"
    )
    v = parser.add_argument_group("--overhead: added latency per request, one replica, no compute")
    v.add_argument(
        "--overhead", action="store_true", help="measure each target's added latency and CPU"
    )
    add_overhead_arguments(v)


def one_run(
    target: str,
    fleet: Fleet,
    workload: Workload,
    config: DriverConfig,
    args: argparse.Namespace,
    log_dir: Path,
    console: Console,
) -> RunResult:
    c = config.sessions_concurrent
    label = f"{target} c={c}"
    flush_caches(fleet.urls)
    before = replica_counters(fleet.urls)
    extra: dict[str, object] = {"target_label": target, "target_version": target_version(target)}
    try:
        with open_target(target, fleet.urls, log_dir, args.gateway_arg, effective_time_scale(args)) as (url, pid):
            cpu0 = process_cpu_s(pid)
            run = run_with_progress(
                workload,
                dataclasses.replace(config, target=url),
                label,
                console,
                extra,
                replicas=len(fleet.urls),
                gpus_per_replica=args.gpus_per_replica,
            )
            extra["target_cpu_s"] = process_cpu_s(pid) - cpu0
    except (RuntimeError, TimeoutError, OSError) as e:
        console.print(f"[red]{target} failed to start: {e}[/]")
        run = RunResult(
            label,
            {**dataclasses.asdict(config), **extra, "error": str(e)},
            (),
            summarize([], replicas=len(fleet.urls), gpus_per_replica=args.gpus_per_replica),
        )
    # the bound for exactly the requests this run sent (infinite cache, perfect affinity)
    extra["oracle_hit_rate"] = oracle_hit_rate(workload, run.records)
    return with_replica_side(run, before, replica_counters(fleet.urls), extra)


def warm_up(fleet: Fleet, workload: Workload, config: DriverConfig,
            args: argparse.Namespace, console: Console) -> None:
    """Discarded load straight at each replica before any target is measured.

    Without it whichever target runs first pays for cold processes (the replicas' first
    requests, the driver's prompt cache and connections): measured as a first-turn TTFT
    of 4.6 s against ~1 s for the same target run later. Caches are flushed afterwards
    (``one_run`` flushes before every target)."""
    if args.warm_up_s <= 0:
        return
    for url in fleet.urls:
        cfg = dataclasses.replace(config, target=url, duration_s=args.warm_up_s, grace_s=0.0)
        run_with_progress(workload, cfg, f"warm-up {url}", console, {"warm_up": True},
                          replicas=1, gpus_per_replica=args.gpus_per_replica)


def discover_model(url: str) -> str:
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        return str(client.get(url + "/v1/models").json()["data"][0]["id"])


def run_peers(args: argparse.Namespace, targets: list[str], console: Console) -> int:
    if args.trace == ["synthetic"]:
        args.trace = []
    error = check_engine_args(args)
    if error:
        console.print(f"[red]{error}[/]")
        return 2
    workload = engine_workload(args, build_workload(args))
    levels = [int(c) for c in args.sessions_concurrent.split(",") if c.strip()]
    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-bench-peers-"))
    profile = scaled_profile(args.profile, args.kv_scale, log_dir)
    console.print(
        f"[bold]kvgate bench peers[/]: {args.replicas} x {fleet_name(args)} (KV x{args.kv_scale:g}, "
        f"time scale {effective_time_scale(args):g}), {len(workload.sessions)} {workload.name} sessions, "
        f"concurrency {levels}, {args.duration_s:g} s per run; logs in {log_dir}"
    )
    runs: list[RunResult] = []
    with sigterm_as_exit(), open_fleet(args, profile, log_dir) as fleet:
        config = DriverConfig(
            target="http://127.0.0.1",
            model=discover_model(fleet.urls[0]),
            time_scale=effective_time_scale(args),
            think_scale=args.think_scale,
            max_think_s=args.max_think_s,
            ramp_s=args.ramp_s,
            max_requests=args.max_requests,
            duration_s=args.duration_s,
            grace_s=args.grace_s,
            seed=args.seed,
            api=args.api,
        )
        warm_up(fleet, workload, dataclasses.replace(config, sessions_concurrent=max(levels)), args, console)
        for c in levels:
            for target in targets:
                cfg = dataclasses.replace(config, sessions_concurrent=c)
                runs.append(one_run(target, fleet, workload, cfg, args, log_dir, console))
    console.print(peers_table(runs, "kvgate bench peers: same sessions, same replicas"))
    if args.json:
        results.write_json(args.json, runs)
        console.print(f"results: {args.json}")
    if args.chart:
        charts.write_charts(args.chart, runs)
        console.print(f"chart: {args.chart}")
    return 0 if all(r.summary.requests > 0 and routing_errors(r) == 0 for r in runs) else 1


def fleet_name(args: argparse.Namespace) -> str:
    if args.engine == "sglang-cpu":
        return f"real SGLang CPU (tiny model, --max-total-tokens {args.max_total_tokens})"
    return str(args.profile)


def run(args: argparse.Namespace) -> int:
    console = Console(width=max(Console().width, 150))  # the tables are wide
    try:
        targets = parse_targets(args.targets)
    except ValueError as e:
        console.print(f"[red]{e}[/]")
        return 2
    if not check_peers(targets, args.install, console):
        return 2
    if args.overhead:
        return run_overhead(args, targets, console)
    return run_peers(args, targets, console)
