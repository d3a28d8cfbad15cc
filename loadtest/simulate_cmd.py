"""`kvgate simulate`: a whole fleet over a trace in virtual time, policies side by side.

Runs the REAL policies (``policies.registry``) and the REAL embedded prefix index
against simulated replicas (``loadtest.simulator``) in virtual time, so a whole trace
takes seconds to minutes. Each policy gets a fresh fleet and index and the same
workload and seed. Prints a table (one row per policy, plus the oracle: infinite cache,
perfect affinity) and optionally writes JSON (``config``, ``oracle``, ``results``).
See loadtest/fleetsim/README.md.

    kvgate simulate --trace ../shared/traces/claude-code --replicas 8 \\
        --profile kimi-k2.6-b200-tp8 --policy cache-aware,round-robin,least-load
    kvgate simulate --trace ../shared/traces/mooncake --policy cache-aware --index approximate,precise

``--index precise`` matches each replica from its engine's KV events (the gateway's
precise mode, `loadtest.fleetsim.precise`); ``approximate`` (the default) is the
gateway's prediction from its own decisions; a comma list runs each policy in each mode.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from gateway.admission import AdmissionConfig
from loadtest import traces
from loadtest.fleetsim.capacity import add_capacity_arguments, run_capacity
from loadtest.fleetsim.metrics import oracle_summary
from loadtest.fleetsim.precise import INDEX_MODES
from loadtest.fleetsim.run import SimConfig, run_policy
from loadtest.fleetsim.sessions import Pacing
from loadtest.fleetsim.table import results_table
from loadtest.simulator.profile import DEFAULT_PROFILE, Profile, load_profile
from loadtest.traces import HALVES, LoadReport
from loadtest.workload import Workload
from policies.registry import DEFAULT_POLICY, POLICY_NAMES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", action="append", required=True, metavar="PATH",
                   help="trace file or folder (plain or .gz); repeatable; 'synthetic' for generated sessions, "
                        "'synthetic-shared' for generated session-less traffic sharing apps' prefixes")
    p.add_argument("--format", choices=("claude-code", "mooncake", "bailian", "synthetic", "synthetic-shared"),
                   default=None,
                   help="trace format (default: detected)")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help="simulator profile name or .toml path; a mixed fleet as NAME:COUNT[,NAME:COUNT...] "
                        "(e.g. kimi-k2.6-b200-tp8:4,kimi-k2.6-b300-tp8:4; sets --replicas)")
    p.add_argument("--speeds", choices=("learned", "no-accept", "fleet"), default="learned",
                   help="learned: the policy prices each replica at the speed learned from its requests and "
                        "the accept length it reports, as the gateway does (replicas/speed.py); no-accept: the "
                        "same without reading the accept length; fleet: every replica at the policy's constants")
    p.add_argument("--gpus-per-replica", type=int, default=None, help="default: the profile's tp_size")
    p.add_argument("--kv-scale", type=float, default=1.0,
                   help="scale the replicas' KV pools (device and host tokens), as `bench peers` does")
    p.add_argument("--policy", default=DEFAULT_POLICY,
                   help=f"policy or comma-separated policies ('all': {','.join(POLICY_NAMES)})")
    p.add_argument("--policy-params", default=None,
                   help='JSON object: policy name -> params, e.g. \'{"cache-aware": {"move_margin_s": 0.5}}\'')
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--sessions-concurrent", type=int, default=None,
                      help="closed loop: sessions active at once (default 64)")
    pace.add_argument("--session-rate", type=float, default=None, help="session starts per simulated second")
    p.add_argument("--limit-sessions", type=int, default=None)
    p.add_argument("--skip-sessions", type=int, default=0,
                   help="drop the trace's first N sessions (another slice of the same trace)")
    p.add_argument("--think-scale", type=float, default=1.0, help="multiply think times")
    p.add_argument("--max-think-s", type=float, default=None, help="cap one think time (simulated s)")
    p.add_argument("--ramp-s", type=float, default=0.0, help="closed loop: first sessions start over this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-requests", type=int, default=None, help="stop sending after this many requests")
    p.add_argument("--sim-duration-s", type=float, default=None, help="stop sending after this simulated time")
    p.add_argument("--loads-poll-s", type=float, default=1.0, help="registry /v1/loads poll interval")
    p.add_argument("--context-length", type=int, default=None,
                   help="override the profile's context length (longer prompts are rejected)")
    p.add_argument("--synthetic-scale", type=float, default=1.0,
                   help="--trace synthetic: multiply every token size (e.g. 0.02 for the tiny profile)")
    p.add_argument("--half", choices=HALVES, default=None,
                   help="open loop: one of two disjoint halves, for held-out evaluation (synthetic-shared: "
                   "independent apps and users, default tuning; a recorded trace: split by each session's "
                   "first block, loadtest.traces.half; default the whole trace)")
    p.add_argument("--rate-scale", type=float, default=1.0,
                   help="open loop (mooncake, bailian, synthetic-shared): replay F times as fast (arrivals / F)")
    p.add_argument("--index", default="approximate", metavar="MODE[,MODE]",
                   help="prefix index mode(s): approximate (own decisions) or precise (the replicas' KV events)")
    p.add_argument("--admission", choices=("on", "off"), default="on",
                   help="the gateway's prefill admission (gateway.admission): hold streaming turns per replica, "
                   "release them shortest predicted prefill first; off = first come, first served")
    p.add_argument("--admission-budget-tokens", type=int, default=None,
                   help="admission.budget_tokens (default: the gateway's)")
    p.add_argument("--admission-max-wait-s", type=float, default=None,
                   help="admission.max_wait_s (default: the gateway's)")
    p.add_argument("--admission-bypass-factor", type=float, default=None,
                   help="admission.bypass_factor (default: the gateway's)")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write results JSON here")
    p.add_argument("--quiet", action="store_true", help="no table")
    add_capacity_arguments(p)


def load_workload(args: argparse.Namespace, report: LoadReport | None = None) -> Workload:
    """The trace's workload (``--rate-scale``: an open-loop one replayed that much faster);
    entries the loaders skipped or defaulted are counted in ``report``."""
    scale = args.rate_scale
    workload = _workload(args, report)
    try:
        return workload if scale == 1.0 else traces.rate_scaled(workload, scale)
    except traces.TraceError as exc:
        raise SystemExit(f"kvgate simulate: --rate-scale: {exc}") from None


def _workload(args: argparse.Namespace, report: LoadReport | None) -> Workload:
    if args.format == "synthetic-shared" or args.trace == ["synthetic-shared"]:
        from loadtest import shared_prefix

        return shared_prefix.generate(seed=args.seed, half=args.half or "tuning").limited(args.limit_sessions)
    if args.format == "synthetic" or args.trace == ["synthetic"]:
        from loadtest.synthetic import SyntheticParams, generate

        params = SyntheticParams(sessions=(args.limit_sessions or 64) + args.skip_sessions).scaled(args.synthetic_scale)
        workload = generate(params, seed=args.seed)
    else:
        limit = None if args.limit_sessions is None else args.skip_sessions + args.limit_sessions
        workload = traces.load([Path(t) for t in args.trace], args.format, limit, report)
    if args.half:
        try:
            workload = traces.half(workload, args.half)
        except traces.TraceError as exc:
            raise SystemExit(f"kvgate simulate: --half: {exc}") from None
    if args.skip_sessions <= 0:
        return workload
    return Workload(workload.name, workload.sessions[args.skip_sessions:], workload.open_loop)


def policy_names(spec: str) -> list[str]:
    names = list(POLICY_NAMES) if spec == "all" else [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICY_NAMES]
    if unknown or not names:
        raise SystemExit(f"kvgate simulate: unknown policy {unknown}; known: {', '.join(POLICY_NAMES)}")
    return names


def index_modes(spec: str) -> list[str]:
    modes = [m.strip() for m in spec.split(",") if m.strip()]
    unknown = [m for m in modes if m not in INDEX_MODES]
    if unknown or not modes:
        raise SystemExit(f"kvgate simulate: unknown --index {unknown}; known: {', '.join(INDEX_MODES)}")
    return modes


def fleet_profiles(spec: str) -> list[tuple[str, int]]:
    """``NAME:COUNT[,NAME:COUNT...]`` -> [(name, count)]; a plain name -> [(name, 0)]
    (0: the ``--replicas`` count)."""
    parts = []
    for part in spec.split(","):
        name, sep, count = part.strip().rpartition(":")
        if not sep or not count.isdigit():
            name, count = part.strip(), "0"
        parts.append((name, int(count)))
    if len(parts) > 1 and any(n == 0 for _, n in parts):
        raise SystemExit(f"--profile {spec!r}: every part of a mixed fleet needs its count (NAME:COUNT)")
    return parts


def _adjusted(args: argparse.Namespace, name: str) -> Profile:
    profile = load_profile(name)
    if args.context_length is not None:
        profile = profile.replace(context_length=args.context_length)
    if args.kv_scale != 1.0:
        profile = profile.replace(
            name=f"{profile.name}-kv{args.kv_scale:g}",
            device_tokens=max(1, int(profile.device_tokens * args.kv_scale)),
            host_tokens=max(1, int(profile.host_tokens * args.kv_scale)))
    return profile


def make_config(args: argparse.Namespace) -> SimConfig:
    parts = fleet_profiles(args.profile)
    mixed: tuple[Profile, ...] = ()
    replicas = args.replicas
    if parts[0][1] > 0:
        mixed = tuple(pr for name, n in parts for pr in [_adjusted(args, name)] * n)
        replicas = len(mixed)
    profile = mixed[0] if mixed else _adjusted(args, parts[0][0])
    pacing = Pacing(
        sessions_concurrent=None if args.session_rate else (args.sessions_concurrent or 64),
        session_rate=args.session_rate, think_scale=args.think_scale, max_think_s=args.max_think_s,
        ramp_s=args.ramp_s, seed=args.seed,
    )
    params = orjson.loads(args.policy_params) if args.policy_params else {}
    overrides = {name: value for name in ("budget_tokens", "max_wait_s", "bypass_factor")
                 if (value := getattr(args, f"admission_{name}", None)) is not None}
    admission = AdmissionConfig(enabled=getattr(args, "admission", "on") == "on", **overrides)
    return SimConfig(profile=profile, replicas=replicas, replica_profiles=mixed, speeds=args.speeds,
                     gpus_per_replica=args.gpus_per_replica or profile.tp_size or 8, pacing=pacing,
                     seed=args.seed, max_requests=args.max_requests, sim_duration_s=args.sim_duration_s,
                     loads_poll_interval_s=args.loads_poll_s, policy_params=params,
                     index_mode=index_modes(getattr(args, "index", "approximate"))[0], admission=admission)


def fleet_name(cfg: SimConfig) -> str:
    """The profile's name, or a mixed fleet's NAME:COUNT list."""
    if not cfg.replica_profiles:
        return cfg.profile.name
    names = [pr.name for pr in cfg.replica_profiles]
    return ",".join(f"{n}:{names.count(n)}" for n in dict.fromkeys(names))


def config_dict(args: argparse.Namespace, cfg: SimConfig, workload: Workload) -> dict[str, Any]:
    return {"trace": args.trace, "format": workload.name, "sessions": len(workload.sessions),
            "skip_sessions": args.skip_sessions, "half": args.half,
            "rate_scale": args.rate_scale, "kv_scale": args.kv_scale,
            "trace_requests": workload.request_count(), "profile": fleet_name(cfg), "speeds": cfg.speeds,
            "context_length": cfg.profile.context_length, "replicas": cfg.replicas,
            "gpus_per_replica": cfg.gpus_per_replica, "pacing": dataclasses.asdict(cfg.pacing),
            "open_loop": workload.open_loop, "seed": cfg.seed, "max_requests": cfg.max_requests,
            "sim_duration_s": cfg.sim_duration_s, "loads_poll_interval_s": cfg.loads_poll_interval_s,
            "policy_params": dict(cfg.policy_params), "index": getattr(args, "index", "approximate"),
            "admission": cfg.admission.model_dump()}


def progress_line(s: dict[str, Any]) -> str:
    hit, p99 = s.get("cache_hit_rate"), s.get("ttft_p99_s")
    return (f"{s['policy']}: {s['requests']:,} requests ({s['rejected']:,} rejected), hit "
            f"{100 * (hit or 0):.2f}% (oracle {100 * (s.get('oracle_cache_hit_rate') or 0):.2f}%), "
            f"TTFT p99 {p99 if p99 is None else round(p99, 3)} s; {s['span_s']:,.0f} simulated s "
            f"in {s['wall_s']:.1f} s wall, {s['cpu_s']:.1f} s CPU")


def run(args: argparse.Namespace) -> int:
    names = policy_names(args.policy)
    modes = index_modes(args.index)
    console = Console(stderr=True)
    t0 = time.perf_counter()
    report = LoadReport()
    workload = load_workload(args, report)
    if args.capacity:
        base = make_config(args)
        return run_capacity(args, workload, base, config_dict(args, base, workload), names)
    cfg = make_config(args)
    console.print(f"loaded {len(workload.sessions)} sessions, {workload.request_count():,} requests "
                  f"in {time.perf_counter() - t0:.1f} s; trace entries {report.summary()}")
    results: list[dict[str, Any]] = []
    oracle: dict[str, Any] = {}
    config = {**config_dict(args, cfg, workload), "trace_entries": report.as_dict()}
    for name, mode in [(n, m) for n in names for m in modes]:
        res = run_policy(workload, name, dataclasses.replace(cfg, index_mode=mode))
        results.append(res.summary)
        oracle = oracle or oracle_summary(res.records, cfg.profile.prefill_tokens_per_s)
        console.print(progress_line(res.summary))
        if args.json_out:  # after every policy, so a long sweep leaves partial results
            doc = {"config": config, "oracle": oracle, "results": results}
            Path(args.json_out).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    if not args.quiet:
        out = Console()
        if not out.is_terminal:
            out = Console(width=170)
        out.print(results_table(oracle, results, caption=f"trace entries: {report.summary()}"))
    return 0
