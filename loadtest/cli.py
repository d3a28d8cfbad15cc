"""`kvgate loadtest`: replay a workload against an OpenAI-compatible endpoint, or sweep policies.

    kvgate loadtest --target http://127.0.0.1:8000 --trace ../shared/traces/claude-code \\
        --sessions-concurrent 32 --limit-sessions 64 --duration-s 120 --json out.json --chart out.png
    kvgate loadtest sweep --policies cache-aware,round-robin --concurrency 8,16,32 \\
        --replicas 4 --profile kimi-k2.6-b200-tp8 --time-scale 10 --duration-s 30 --chart sweep.png
    kvgate loadtest sweep --engine sglang-cpu --replicas 2 --trace ../shared/traces/claude-code \\
        --limit-sessions 8 --concurrency 4 --think-scale 0.05 --max-think-s 2 --duration-s 60

The target may be kvgate, a peer router or a single replica; non-loopback targets are
refused unless ``--allow-remote``. ``sweep`` starts a simulated fleet and, for every
(policy, concurrency), flushes the replicas' caches and starts a fresh gateway
(`kvgate serve --policy P`) over it, then draws throughput-vs-interactivity for all.
With ``--engine sglang-cpu`` the fleet is real SGLang CPU servers and the workload is
scaled to the tiny model (`loadtest.sglang_cpu.harness`); ``--api`` picks the API spoken.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from rich.console import Console

from loadtest import charts, results, synthetic, traces
from loadtest.driver import DriverConfig, check_target
from loadtest.report import run_with_progress, summary_table, sweep_table
from loadtest.results import RunResult
from loadtest.sglang_cpu.harness import (
    add_engine_arguments,
    check_engine_args,
    effective_time_scale,
    engine_workload,
)
from loadtest.workload import Workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("mode", nargs="?", choices=["run", "sweep"], default="run",
                        help="run (default): drive --target; sweep: simulated fleet x policies x concurrency")
    parser.add_argument("--target", help="base URL of an OpenAI-compatible endpoint (run)")
    parser.add_argument("--trace", action="append", default=[], metavar="PATH",
                        help="trace file or folder (repeatable); none: the synthetic generator")
    parser.add_argument("--format", choices=traces.FORMATS, default=None, help="trace format (default: detect)")
    parser.add_argument("--model", help="model name to send (default: the target's first /v1/models id)")
    parser.add_argument("--sessions-concurrent", type=int, default=16, help="closed-loop sessions at once")
    parser.add_argument("--session-rate", type=float, default=None,
                        help="sessions arrive as a Poisson process, per target second")
    parser.add_argument("--time-scale", type=float, default=1.0, help="divide every wait by this")
    parser.add_argument("--think-scale", type=float, default=1.0, help="multiply think times by this")
    parser.add_argument("--max-think-s", type=float, default=None, help="cap one think time (target s)")
    parser.add_argument("--ramp-s", type=float, default=0.0, help="spread the first sessions' starts (target s)")
    parser.add_argument("--limit-sessions", type=int, default=None, help="use at most N sessions")
    parser.add_argument("--max-requests", type=int, default=None, help="send at most N requests")
    parser.add_argument("--duration-s", type=float, default=None, help="stop starting requests after S wall s")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write results JSON")
    parser.add_argument("--keep-itl", action="store_true", help="keep every inter-token gap in the JSON")
    parser.add_argument("--chart", type=Path, default=None, metavar="OUT.png", help="write charts")
    parser.add_argument("--gpus-per-replica", type=int, default=8)
    parser.add_argument("--target-replicas", type=int, default=None,
                        help="replicas behind the target (default: distinct x-kvgate-replica seen, or 1)")
    parser.add_argument("--label", default=None, help="run label (default: the target)")
    parser.add_argument("--allow-remote", action="store_true", help="allow a non-loopback target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--synthetic-sessions", type=int, default=64, help="sessions of the synthetic workload")
    parser.add_argument("--synthetic-token-scale", type=float, default=1.0,
                        help="multiply the synthetic workload's token sizes (e.g. 0.02 for the tiny profile)")
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument("--policies", default="cache-aware,round-robin")
    sweep.add_argument("--concurrency", default="8,16,32", help="comma-separated session concurrencies")
    sweep.add_argument("--replicas", type=int, default=4, help="simulated replicas")
    sweep.add_argument("--profile", default="tiny", help="replica profile (tiny, kimi-k2.6-b200-tp8, or a .toml)")
    sweep.add_argument("--gateway-arg", action="append", default=[], help="extra `kvgate serve` argument")
    add_engine_arguments(sweep)


def build_workload(args: argparse.Namespace) -> Workload:
    if args.format == "synthetic" or not args.trace:
        params = synthetic.SyntheticParams(sessions=args.limit_sessions or args.synthetic_sessions)
        if args.synthetic_token_scale != 1.0:
            params = params.scaled(args.synthetic_token_scale)
        return synthetic.generate(params, args.seed)
    report = traces.LoadReport()
    workload = traces.load(args.trace, args.format, args.limit_sessions, report)
    print(f"trace entries skipped or defaulted: {report.summary()}")
    return workload


def driver_config(args: argparse.Namespace, target: str) -> DriverConfig:
    return DriverConfig(
        target=target, model=args.model, sessions_concurrent=args.sessions_concurrent,
        session_rate=args.session_rate, time_scale=args.time_scale, think_scale=args.think_scale,
        max_think_s=args.max_think_s, ramp_s=args.ramp_s, max_requests=args.max_requests,
        duration_s=args.duration_s, keep_itl=args.keep_itl, allow_remote=args.allow_remote,
        seed=args.seed, api=args.api)


def _finish(args: argparse.Namespace, runs: list[RunResult], console: Console) -> None:
    if args.json:
        results.write_json(args.json, runs, keep_itl=args.keep_itl)
        console.print(f"results: {args.json}")
    if args.chart:
        charts.write_charts(args.chart, runs)
        console.print(f"charts: {args.chart}")


def run_single(args: argparse.Namespace, console: Console) -> int:
    if not args.target:
        console.print("[red]--target is required[/] (or use `kvgate loadtest sweep`)")
        return 2
    config = driver_config(args, check_target(args.target, args.allow_remote))
    workload = build_workload(args)
    run = run_with_progress(workload, config, args.label or args.target, console,
                            replicas=args.target_replicas, gpus_per_replica=args.gpus_per_replica)
    console.print(summary_table([run]))
    driver = run.config["driver"]
    console.print(f"driver: {driver['max_inflight']} streams in flight at most, "
                  f"{100 * driver['driver_cpu_frac']:.0f}% of one core")
    _finish(args, [run], console)
    return 0 if run.summary.ok else 1


def run_sweep(args: argparse.Namespace, console: Console) -> int:
    from loadtest.demo import policy_run, sigterm_as_exit
    from loadtest.sglang_cpu.harness import open_fleet

    error = check_engine_args(args)
    if error:
        console.print(f"[red]{error}[/]")
        return 2
    workload = engine_workload(args, build_workload(args))
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    runs: list[RunResult] = []
    base = dataclasses.replace(driver_config(args, "http://127.0.0.1"), time_scale=effective_time_scale(args))
    with sigterm_as_exit(), open_fleet(args, args.profile, None) as fleet:
        for policy in policies:
            for c in levels:
                config = dataclasses.replace(base, sessions_concurrent=c)
                runs.append(policy_run(policy, fleet.urls, workload, config, f"{policy} c={c}", console,
                                       args.gpus_per_replica, args.gateway_arg))
    console.print(sweep_table(runs))
    _finish(args, runs, console)
    return 0


def run(args: argparse.Namespace) -> int:
    console = Console()
    return run_sweep(args, console) if args.mode == "sweep" else run_single(args, console)
