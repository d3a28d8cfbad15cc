"""``kvgate sim``: run one simulated SGLang replica, or a fleet of them.

    kvgate sim --port 31001 --profile kimi-k2.6-b200-tp8 [--time-scale 100] [--seed 1]
    kvgate sim --replicas 4 --base-port 31001          # one process per replica

One replica: uvicorn (programmatic; log level warning, no access log) serving
:func:`loadtest.simulator.server.build_app`. SIGTERM drains like SGLang (health and
readiness 503, every request still served, exit when none is in flight); SIGINT stops
at once. A fleet starts ``--replicas`` child processes (replica ``i`` on
``base_port + i`` with seed ``seed + i``) and stops them all on SIGINT/SIGTERM.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from typing import Any

from loadtest.simulator.faults import DIE_MODES, FaultConfig, FaultConfigError
from loadtest.simulator.profile import DEFAULT_PROFILE, ProfileError, load_profile

DEFAULT_PORT = 31001


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port of a single replica")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="profile name or .toml path")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="simulated seconds per wall second (default: the profile's)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (replica i: seed + i)")
    parser.add_argument("--replicas", type=int, default=1, help="run a fleet of N processes")
    parser.add_argument("--base-port", type=int, default=None,
                        help="fleet: replica i listens on base-port + i (default --port)")
    parser.add_argument("--log-level", default="warning", help="log level (default warning)")
    faults = parser.add_argument_group("fault injection (tests; also POST /_sim/faults)")
    faults.add_argument("--error-rate", type=float, default=0.0,
                        help="fraction of requests answered --error-status before the first byte")
    faults.add_argument("--error-status", type=int, default=503)
    faults.add_argument("--latency-s", type=float, default=0.0, help="wall seconds added per request")
    faults.add_argument("--hang-rate", type=float, default=0.0,
                        help="fraction of requests accepted and never answered")
    faults.add_argument("--die-after-chunks", type=int, default=None,
                        help="streams lose their connection after N events")
    faults.add_argument("--die-mode", choices=DIE_MODES, default="close",
                        help="close the connection, or exit the process")


def _faults(args: argparse.Namespace) -> FaultConfig:
    return FaultConfig(error_rate=args.error_rate, error_status=args.error_status,
                       latency_s=args.latency_s, hang_rate=args.hang_rate,
                       die_after_chunks=args.die_after_chunks, die_mode=args.die_mode)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        faults = _faults(args)
        profile = load_profile(args.profile)
    except (FaultConfigError, ProfileError) as e:
        print(f"kvgate sim: {e}", file=sys.stderr)
        return 2
    if args.replicas > 1:
        return _run_fleet(args)
    time_scale = args.time_scale if args.time_scale is not None else profile.time_scale
    from loadtest.simulator.config import SimServerConfig

    config = SimServerConfig(profile=profile, time_scale=time_scale, seed=args.seed, host=args.host,
                          port=args.port, faults=faults, handle_sigterm=True)
    asyncio.run(_serve(config, args.log_level))
    return 0


async def _serve(config: Any, log_level: str) -> None:
    import uvicorn

    from loadtest.simulator.server import build_app

    holder: dict[str, uvicorn.Server] = {}

    def drained() -> None:
        holder["server"].should_exit = True

    app = build_app(config, on_drained=drained)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                           log_level=log_level.lower(), access_log=False,
                                           lifespan="on", timeout_graceful_shutdown=5))
    holder["server"] = server
    announce = asyncio.create_task(_announce(server, config))
    try:
        await server.serve()
    finally:
        announce.cancel()


async def _announce(server: Any, config: Any) -> None:
    while not server.started:
        await asyncio.sleep(0.01)
    print(f"kvgate sim: replica listening on http://{config.host}:{config.port} "
          f"profile={config.profile.name} time_scale={config.time_scale:g}", flush=True)


def _run_fleet(args: argparse.Namespace) -> int:
    from loadtest.simulator.fleet import SimFleet

    extra = ["--log-level", args.log_level]
    for flag, value, default in (("--error-rate", args.error_rate, 0.0),
                                 ("--error-status", args.error_status, 503),
                                 ("--latency-s", args.latency_s, 0.0),
                                 ("--hang-rate", args.hang_rate, 0.0),
                                 ("--die-after-chunks", args.die_after_chunks, None),
                                 ("--die-mode", args.die_mode, "close")):
        if value != default:
            extra += [flag, str(value)]
    stop = {"signal": 0}

    def on_signal(signum: int, frame: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    fleet = SimFleet(args.replicas, profile=args.profile, time_scale=args.time_scale,
                     base_port=args.base_port or args.port, seed=args.seed, extra_args=extra,
                     host=args.host)
    with fleet:
        for i, url in enumerate(fleet.urls):
            print(f"kvgate sim: replica {i} listening on {url} profile={args.profile} "
                  f"(log {fleet.log_path(i)})", flush=True)
        while not stop["signal"] and all(p.poll() is None for p in fleet.procs):
            time.sleep(0.2)
    print("kvgate sim: fleet stopped", flush=True)
    return 0
