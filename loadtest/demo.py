"""`kvgate demo`: a simulated fleet, the gateway, real Claude Code sessions, policies side by side.

Starts ``--replicas`` simulated replicas (default 4 x ``kimi-k2.6-b200-tp8``, time-scaled),
then for each policy (``cache-aware``, then ``round-robin``) a fresh gateway process on
the in-memory index over the same replicas (their caches flushed in between), replays
the same slice of the Claude Code sessions in ``../shared/traces/claude-code`` beside the project (the synthetic generator when it is
absent) for
``--duration-s`` wall seconds each, and prints a side-by-side table. Everything it starts
is stopped on exit, on Ctrl-C and on SIGTERM.

Why the defaults: 48 concurrent sessions over 4 replicas at time scale 10 (one wall
second = ten simulated seconds) give ~15 turns per session in 40 s: enough for each
round-robin session to pay a cold prefill on every replica it touches (and to re-send
the history it grew elsewhere) while cache-aware pays it once. Think times are capped
at 30 simulated seconds (the traces hold user pauses of hours).

The orchestration helpers (`GatewayProcess`, `flush_caches`, `policy_run`) are shared with
`kvgate loadtest sweep`.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Self

import httpx
from rich.console import Console

from loadtest import charts, results, synthetic, traces
from loadtest.driver import DriverConfig
from loadtest.report import run_with_progress, summary_table
from loadtest.results import RunResult
from loadtest.simulator.fleet import SimFleet, stop_process
from loadtest.simulator.ports import free_port
from loadtest.workload import Session, Workload

ROOT = Path(__file__).resolve().parents[1]
TRACE_DIRS = (ROOT.parent / "shared" / "traces" / "claude-code",)
DEFAULT_PROFILE = "kimi-k2.6-b200-tp8"
# --kv-events: each simulated replica binds its own free loopback port (port 0)
KV_EVENTS_CONFIG = '{"publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0", "topic": "kv"}'


class GatewayProcess:
    """``kvgate serve`` in a child process on a free loopback port (in-memory index)."""

    def __init__(self, policy: str, replica_urls: Sequence[str], extra_args: Sequence[str] = (),
                 ready_timeout_s: float = 30.0, log_dir: Path | None = None, root: Path = ROOT,
                 time_scale: float = 1.0) -> None:
        """``root``: the kvgate checkout to run (``python -m gateway.cli`` from there).

        ``time_scale``: the replicas' (simulated seconds per wall second). Time-scaled replicas
        run that many times faster than the hardware they simulate, so the gateway does not
        learn their speeds (``registry.learn_speeds=false``): learned in wall time, the figures
        would leave the learner's bounds ([0.25x, 4x] of the fleet constants) and price queues
        in wall seconds against the cost model's margins, which are in real seconds. Priced at
        the constants, the policy decides in the simulated time it was built for (at time
        scale 10, `kvgate demo`'s cache-aware TTFT p99 was 10.9 s learning, 3.4 s not)."""
        self.root = root
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if time_scale != 1.0:  # an environment variable: an older checkout without the setting ignores it
            self.env["KVGATE_REGISTRY__LEARN_SPEEDS"] = "false"
        self.args = ["--policy", policy, "--log-level", "warning",
                     *(a for u in replica_urls for a in ("--replica", u)), *extra_args]
        self._choose_port()
        name = f"gateway-{policy}" + ("" if root == ROOT else f"-{root.name}")  # two checkouts, two logs
        self.log_path = (log_dir or Path(tempfile.mkdtemp(prefix="kvgate-gw-"))) / f"{name}.log"
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def _choose_port(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1",
                    "--port", str(self.port), *self.args]

    def __enter__(self) -> Self:
        for attempt in range(3):
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(self.root),
                                             env=self.env,
                                             start_new_session=True)
            try:
                self._wait_ready()
                return self
            except RuntimeError:
                self.stop()
                # the free port was taken between choosing and binding: take another one
                if attempt == 2 or "address already in use" not in self.log_path.read_text(errors="replace"):
                    raise
                self._choose_port()
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        with httpx.Client(timeout=1.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"gateway exited ({self.proc.returncode}); log: {self.log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.url + "/ready").status_code == 200:
                        return
                time.sleep(0.1)
        raise TimeoutError(f"gateway not ready after {self.ready_timeout_s}s; log: {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def flush_caches(urls: Sequence[str], timeout_s: float = 60.0) -> None:
    """POST /flush_cache to every replica, retrying while one is busy (400)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        for url in urls:
            while client.post(url + "/flush_cache").status_code != 200:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url}/flush_cache: replica never idle")
                time.sleep(0.2)


def policy_run(policy: str, fleet_urls: Sequence[str], workload: Workload, config: DriverConfig,
               label: str, console: Console, gpus_per_replica: int = 8,
               gateway_args: Sequence[str] = (), show_predictions: bool = False) -> RunResult:
    """Flush the replicas, start a gateway with ``policy``, drive ``workload`` through it;
    ``show_predictions``: print how close the gateway's cached-token predictions were."""
    flush_caches(fleet_urls)
    with GatewayProcess(policy, fleet_urls, gateway_args, time_scale=config.time_scale) as gw:
        cfg = dataclasses.replace(config, target=gw.url)
        run = run_with_progress(workload, cfg, label, console, {"policy": policy},
                                replicas=len(fleet_urls), gpus_per_replica=gpus_per_replica)
        if show_predictions:
            metrics = httpx.get(gw.url + "/metrics", timeout=10.0, trust_env=False).text
            console.print(f"{label}: {prediction_summary(metrics)}")
        return run


def prediction_summary(metrics_text: str) -> str:
    """Per index mode, how close the predicted cached tokens were to the reported ones (the
    gateway's ``kvgate_prediction_error_tokens``, predicted minus reported): the share
    within 64 tokens (one page of the default profile), within 1,024, and the shares
    predicted more than 64 too low and too high. Approximate mode estimates tokens from
    characters, so it is rarely within a page even when the whole prefix hit."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "kvgate_prediction_error_tokens":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                buckets.setdefault(sample.labels["mode"], {})[float(sample.labels["le"])] = sample.value
    parts = []
    for mode in ("precise", "approximate"):
        b = buckets.get(mode, {})
        total = b.get(math.inf, 0.0)
        if total:
            def pct(n: float, total: float = total) -> str:
                return f"{100 * n / total:.1f}%"
            parts.append(f"{mode} {pct(b.get(64.0, 0.0) - b.get(-64.0, 0.0))} within 64 tokens, "
                         f"{pct(b.get(1024.0, 0.0) - b.get(-1024.0, 0.0))} within 1,024, "
                         f"{pct(b.get(-64.0, 0.0))} lower, {pct(total - b.get(64.0, 0.0))} higher "
                         f"(of {total:.0f})")
    return "predicted vs reported cached tokens: " + ("; ".join(parts) or "no reports")


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit so context managers stop every child process."""
    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def scaled_profile(name_or_path: str, kv_scale: float, out_dir: Path) -> str:
    """A copy of a replica profile with its KV pools (device and host tokens) scaled.

    Returns the profile unchanged when ``kv_scale`` is 1, else the path of a TOML file
    written in ``out_dir`` (every other parameter is kept).
    """
    if kv_scale == 1.0:
        return name_or_path
    from loadtest.simulator.profile import load_profile

    profile = load_profile(name_or_path)  # resolved: launch facts included, so the copy stands alone
    data = dataclasses.asdict(profile)
    for key in ("device_tokens", "host_tokens"):
        data[key] = max(1 if key == "device_tokens" else 0, int(data[key] * kv_scale))
    data["name"] = f"{profile.name}-kv{kv_scale:g}"
    data["spec_algorithm"] = data["spec_algorithm"] or ""
    out = out_dir / f"{data['name']}.toml"
    out.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in data.items()), encoding="utf-8")
    return str(out)


def demo_workload(sessions: int, trace: Path | None, seed: int, max_prompt_tokens: int) -> Workload:
    """``sessions`` Claude Code sessions (in file order) whose prompts all fit the context.

    The recorded sessions ran on 1M-token contexts; sessions with a prompt over
    ``max_prompt_tokens`` would only produce context-length errors on a 256k model.
    """
    loaded: Workload | None = None
    for folder in ([trace] if trace else list(TRACE_DIRS)):
        if folder.is_dir() and traces.trace_files(folder):
            loaded = traces.load([folder], "claude-code", limit_sessions=3 * sessions)
            break
    if loaded is None:
        params = synthetic.SyntheticParams(sessions=2 * sessions, compact_at_tokens=int(0.8 * max_prompt_tokens))
        loaded = synthetic.generate(params, seed)
    fits = [s for s in loaded.sessions if _max_prompt(s) <= max_prompt_tokens]
    return Workload(loaded.name, tuple(fits[:sessions]))


def _max_prompt(session: Session) -> int:
    return max((max([t.in_tokens + t.out_tokens, *(_max_prompt(s) for s in t.subagents)])
                for t in session.turns), default=0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=4, help="simulated replicas (default 4)")
    parser.add_argument("--sessions", type=int, default=32, help="concurrent sessions (default 32)")
    parser.add_argument("--time-scale", type=float, default=10.0,
                        help="simulated seconds per wall second (default 10)")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help=f"replica profile (default {DEFAULT_PROFILE})")
    parser.add_argument("--kv-scale", type=float, default=0.25,
                        help="scale the replicas' KV pools (default 0.25; 1 = the profile as is)")
    parser.add_argument("--duration-s", type=float, default=40.0, help="wall seconds per policy (default 40)")
    parser.add_argument("--max-think-s", type=float, default=30.0,
                        help="cap on a think time, simulated seconds (default 30)")
    parser.add_argument("--ramp-s", type=float, default=60.0,
                        help="start the sessions over this many simulated seconds (default 60)")
    parser.add_argument("--max-prompt-tokens", type=int, default=240_000,
                        help="skip sessions with a longer prompt (default 240000; the model has 256k)")
    parser.add_argument("--policies", default="cache-aware,round-robin", help="comma-separated policies")
    parser.add_argument("--trace", type=Path, default=None, help="Claude Code trace folder")
    parser.add_argument("--gpus-per-replica", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-events", action="store_true",
                        help="replicas publish SGLang KV events: the gateways route in precise mode "
                             "(docs/precise.md)")
    parser.add_argument("--json", type=Path, default=None, help="write the results JSON here")
    parser.add_argument("--chart", type=Path, default=None, help="write the charts PNG here")


def run(args: argparse.Namespace) -> int:
    console = Console()
    workload = demo_workload(args.sessions * 2, args.trace, args.seed, args.max_prompt_tokens)
    profile = scaled_profile(args.profile, args.kv_scale, Path(tempfile.mkdtemp(prefix="kvgate-demo-")))
    console.print(f"[bold]kvgate demo[/]: {args.replicas} x {args.profile} (KV pools x{args.kv_scale:g}, "
                  f"time scale {args.time_scale:g}), {args.sessions} concurrent {workload.name} sessions, "
                  f"{args.duration_s:.0f} s per policy")
    config = DriverConfig(target="http://127.0.0.1", sessions_concurrent=args.sessions,
                          time_scale=args.time_scale, max_think_s=args.max_think_s,
                          ramp_s=args.ramp_s, duration_s=args.duration_s, grace_s=10.0, seed=args.seed)
    runs: list[RunResult] = []
    events = ("--kv-events-config", KV_EVENTS_CONFIG) if args.kv_events else ()
    with sigterm_as_exit(), SimFleet(args.replicas, profile=profile, time_scale=args.time_scale,
                                     seed=args.seed, extra_args=events) as fleet:
        for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
            runs.append(policy_run(policy, fleet.urls, workload, config, policy, console,
                                   args.gpus_per_replica, show_predictions=True))
    console.print(summary_table(runs, "kvgate demo: same sessions, same replicas"))
    if args.json:
        results.write_json(args.json, runs)
    if args.chart:
        charts.write_charts(args.chart, runs)
    return 0 if all(r.summary.ok for r in runs) else 1
