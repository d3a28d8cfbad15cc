"""``kvgate sim``: run one simulated SGLang replica, or a fleet of them.

    kvgate sim --port 31001 --profile kimi-k2.6-b200-tp8 [--time-scale 100] [--seed 1] [--model NAME]
    kvgate sim --replicas 4 --base-port 31001          # one process per replica
    kvgate sim --ssl-certfile cert.pem --ssl-keyfile key.pem   # https (uvicorn's TLS)

One replica: uvicorn (programmatic; log level warning, no access log) serving
:func:`loadtest.simulator.server.build_app`. SIGTERM drains like SGLang (health and
readiness 503, every request still served, exit when none is in flight); SIGINT stops
at once. A fleet starts ``--replicas`` child processes (replica ``i`` on
``base_port + i`` with seed ``seed + i``) and stops them all on SIGINT/SIGTERM.

``--kv-events-config '{"publisher":"zmq","endpoint":"tcp://*:P","topic":"kv"}'`` (SGLang's flag
and JSON; port 0 = a free port, required for a fleet) publishes the replica's KV events
(``kv_publisher.py``): the engine gets a ``KvEventRecorder`` and the app's lifespan runs the
``ZmqKvPublisher`` around the server's own (no change to ``server.py``).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
import time
from typing import Any

from loadtest.simulator.faults import DIE_MODES, FaultConfig, FaultConfigError
from loadtest.simulator.kv_publisher import (
    KvEventRecorder,
    KvEventsConfig,
    KvEventsConfigError,
    ZmqKvPublisher,
    with_free_ports,
)
from loadtest.simulator.profile import DEFAULT_PROFILE, ProfileError, load_profile

DEFAULT_PORT = 31001


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port of a single replica")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="profile name or .toml path")
    parser.add_argument("--model", default=None, metavar="NAME",
                        help="served model name (/v1/models, /model_info, /server_info; default: the profile's)")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="simulated seconds per wall second (default: the profile's)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (replica i: seed + i)")
    parser.add_argument("--replicas", type=int, default=1, help="run a fleet of N processes")
    parser.add_argument("--base-port", type=int, default=None,
                        help="fleet: replica i listens on base-port + i (default --port)")
    parser.add_argument("--log-level", default="warning", help="log level (default warning)")
    parser.add_argument("--ssl-certfile", default=None, metavar="PEM",
                        help="serve https with this certificate (chain) file (with --ssl-keyfile)")
    parser.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="the private key of --ssl-certfile")
    parser.add_argument("--kv-events-config", default=None, metavar="JSON",
                        help='publish KV events as SGLang does, e.g. \'{"publisher":"zmq",'
                             '"endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}\'')
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
        if args.model is not None:
            if not args.model.strip() or "/" in args.model or args.model in (".", ".."):
                raise ProfileError(f"--model {args.model!r}: a non-empty name without '/'")
            profile = dataclasses.replace(profile, served_model_name=args.model)
        kv_events = KvEventsConfig.from_json(args.kv_events_config) if args.kv_events_config else None
    except (FaultConfigError, ProfileError, KvEventsConfigError) as e:
        print(f"kvgate sim: {e}", file=sys.stderr)
        return 2
    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        print("kvgate sim: --ssl-certfile and --ssl-keyfile go together", file=sys.stderr)
        return 2
    if args.replicas > 1:
        if kv_events is not None and not _free_ports_only(kv_events):
            print("kvgate sim: with --replicas, --kv-events-config ports must be 0 (a free port each)",
                  file=sys.stderr)
            return 2
        return _run_fleet(args)
    if kv_events is not None:
        kv_events = with_free_ports(kv_events, args.host)
    time_scale = args.time_scale if args.time_scale is not None else profile.time_scale
    from loadtest.simulator.config import SimServerConfig

    config = SimServerConfig(profile=profile, time_scale=time_scale, seed=args.seed, host=args.host,
                          port=args.port, faults=faults, handle_sigterm=True, kv_events=kv_events)
    asyncio.run(_serve(config, args.log_level, args.ssl_certfile, args.ssl_keyfile))
    return 0


async def _serve(config: Any, log_level: str, ssl_certfile: str | None = None,
                 ssl_keyfile: str | None = None) -> None:
    import uvicorn

    from loadtest.simulator.server import build_app

    holder: dict[str, uvicorn.Server] = {}

    def drained() -> None:
        holder["server"].should_exit = True

    app = build_app(config, on_drained=drained)
    _attach_kv_events(app, config)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                           log_level=log_level.lower(), access_log=False,
                                           lifespan="on", timeout_graceful_shutdown=5,
                                           ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile))
    holder["server"] = server
    announce = asyncio.create_task(_announce(server, config, "https" if ssl_certfile else "http"))
    try:
        await server.serve()
    finally:
        announce.cancel()


def _free_ports_only(kv: KvEventsConfig) -> bool:
    return all(e is None or e.endswith(":0") for e in (kv.endpoint, kv.replay_endpoint))


def _attach_kv_events(app: Any, config: Any) -> None:
    """Give the replica's engine a recorder publishing over ZMQ, run by the app's lifespan."""
    kv: KvEventsConfig | None = config.kv_events
    if kv is None or not kv.enabled:
        return
    publisher = ZmqKvPublisher(kv, config.host)
    app.state.replica.engine.attach_events(KvEventRecorder(config.profile.page_size, publisher.publish))
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: Any) -> Any:
        async with publisher.running(), inner(a):
            yield

    app.router.lifespan_context = lifespan
    app.state.kv_publisher = publisher


async def _announce(server: Any, config: Any, scheme: str) -> None:
    while not server.started:
        await asyncio.sleep(0.01)
    print(f"kvgate sim: replica listening on {scheme}://{config.host}:{config.port} "
          f"profile={config.profile.name} time_scale={config.time_scale:g}", flush=True)


def _run_fleet(args: argparse.Namespace) -> int:
    from loadtest.simulator.fleet import SimFleet

    extra = ["--log-level", args.log_level]
    if args.model is not None:
        extra += ["--model", args.model]
    if args.kv_events_config:
        extra += ["--kv-events-config", args.kv_events_config]
    tls = (args.ssl_certfile, args.ssl_keyfile) if args.ssl_certfile else None
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
                     host=args.host, tls=tls)
    with fleet:
        for i, url in enumerate(fleet.urls):
            print(f"kvgate sim: replica {i} listening on {url} profile={args.profile} "
                  f"(log {fleet.log_path(i)})", flush=True)
        while not stop["signal"] and all(p.poll() is None for p in fleet.procs):
            time.sleep(0.2)
    print("kvgate sim: fleet stopped", flush=True)
    return 0
