"""`kvgate serve`: run the gateway (FastAPI on Granian, ``gateway/server.py``).

Every flag is a shortcut for one settings field (``FLAG_FIELDS``); ``--set a.b=v`` sets
any other field (the value is parsed as JSON when it parses, else taken as a string).
Flags override the environment (``KVGATE_...``), which overrides ``--config``.

Server: embedded Granian on uvloop (``gateway/server.py``: header and body deadlines,
connection and concurrency caps, graceful shutdown). The ports are reserved here first
(the main one, and ``admin.port``'s when set), then the admin token is resolved
(``admin.token``, or ``admin.token_file``, or generated into a 0600 file whose path is
logged and which is removed at exit). ``--workers N`` runs N gateway processes on those
ports (``Workers``; each child builds its own app and server from the same settings,
handed to it inside the pickled process object: ``AppFactory``, never through the
environment, where the admin token and the replica API key would be inherited by every
child process and readable in ``/proc/<pid>/environ``). Workers share routing state only
through Redis (``--redis-url``): without it each has its own prefix index, and affinity is
per worker.

A bad configuration (file syntax, a field's value, an unreadable token file) is one
line on stderr, ``kvgate serve: config file X, line N: field a.b: ...``, exit 2.

Garbage collection: the objects alive at start-up (FastAPI, pydantic, prometheus, the
policy: ~10^5 objects) are moved out of the collector's reach (``gc.freeze``), so the
full collections that a 400 KB body's thousands of parsed objects trigger now and then
scan only what requests allocate (they were the 400 KB request's p99: +30 ms).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import gc
import json
import logging
import multiprocessing
import os
import resource
import signal
import socket
import sys
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway import access_log
from gateway.settings import Settings, load_settings, set_path

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.types import Receive, Scope, Send

    from gateway.metrics import GatewayMetrics

log = logging.getLogger("kvgate.serve")
FD_MARGIN = 64  # files, Redis, listeners, logs beside client and upstream connections

# flag dest -> settings fields (dotted); flags left unset do not override anything.
# --redis-url is what several gateways share: the prefix index and the replica state.
FLAG_FIELDS: dict[str, tuple[str, ...]] = {
    "host": ("host",),
    "port": ("port",),
    "replica": ("registry.replicas",),
    "policy": ("policy.name",),
    "admin_token": ("admin.token",),
    "admin_token_file": ("admin.token_file",),
    "redis_url": ("index.redis_url", "registry.shared.redis_url"),
    "log_level": ("log_level",),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="listen address (settings: host; default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (settings: port; default 8000)")
    parser.add_argument("--replica", action="append", metavar="URL",
                        help="replica URL, repeatable (settings: registry.replicas)")
    parser.add_argument("--policy", metavar="NAME", help="routing policy (settings: policy.name)")
    parser.add_argument("--admin-token", metavar="T", help="bearer token for /admin (settings: admin.token; "
                        "default: generated at start-up into a 0600 file whose path is logged)")
    parser.add_argument("--admin-token-file", metavar="FILE",
                        help="read the admin token from FILE (settings: admin.token_file)")
    parser.add_argument("--config", type=Path, metavar="FILE", help="TOML or YAML config file")
    parser.add_argument("--redis-url", metavar="URL",
                        help="Redis shared by several gateways: prefix index and replica state "
                        "(settings: index.redis_url, registry.shared.redis_url)")
    parser.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"],
                        help="settings: log_level (default info)")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="gateway processes on the port (default 1; share state via --redis-url)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", dest="set_fields",
                        help="set any settings field, e.g. --set policy.params.alpha=0.5 (repeatable)")


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given on the command line, as a nested settings dict."""
    overrides: dict[str, Any] = {}
    for item in args.set_fields:
        field, sep, value = item.partition("=")
        if not sep or not field:
            raise SystemExit(f"--set expects FIELD=VALUE, got {item!r}")
        set_path(overrides, field.strip(), _parse_value(value))
    for dest, fields in FLAG_FIELDS.items():
        value = getattr(args, dest, None)
        if value is not None:
            for field in fields:
                set_path(overrides, field, value)
    return overrides


def settings_from_args(args: argparse.Namespace) -> Settings:
    return load_settings(args.config, overrides_from_args(args))


class InferenceFastPath:
    """ASGI front: POSTs to the inference paths go straight to ``Gateway.handle``.

    Skips FastAPI's middleware stack and router (five layers, ~8% of the gateway's CPU on
    a small request); every other request, and the lifespan, goes to the app unchanged."""

    def __init__(self, app: FastAPI) -> None:
        from starlette.requests import ClientDisconnect, Request

        from gateway.app import ENDPOINT_PATHS
        from gateway.errors import GatewayError
        from gateway.relay import error_response

        self.app = app
        self.endpoints = {path: endpoint for endpoint, path in ENDPOINT_PATHS.items()}
        self.request, self.error, self.error_response = Request, GatewayError, error_response
        self.disconnect = ClientDisconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.endpoints.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" \
            else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        try:
            response = await self.app.state.gateway.handle(self.request(scope, receive), endpoint)
        except self.disconnect:  # the client left during the upload: nobody to answer
            log.debug("client disconnected during the request body")
            return
        except Exception as exc:  # as the app's own handler: logged, a 500 in the API's shape
            log.exception("inference request failed")
            response = self.error_response(self.error(f"internal gateway error ({type(exc).__name__})"), None, endpoint)
        await response(scope, receive, send)


def run(args: argparse.Namespace) -> int:
    from gateway.admin import resolve_admin_token
    from policies.registry import make_policy

    try:
        settings = settings_from_args(args)
        make_policy(settings.policy.name, settings.policy.params, settings.policy.seed)  # typos fail here
    except (ValueError, OSError) as exc:  # ConfigError (one line), a policy's ValueError
        print(f"kvgate serve: {one_line(exc)}", file=sys.stderr)
        return 2
    _log_setup(settings)
    try:
        settings, sockets = bind_listeners(settings)
    except OSError as exc:
        print(f"kvgate serve: cannot listen on {settings.host}:{settings.port}: "
              f"{(exc.strerror or str(exc)).lower()}", file=sys.stderr)
        return 1
    try:
        settings, generated = resolve_admin_token(settings, settings.admin.port or settings.port)
    except ValueError as exc:
        print(f"kvgate serve: {one_line(exc)}", file=sys.stderr)
        return 2
    if generated is not None:
        log.warning("admin API: no token configured; generated one into %s (mode 0600; removed at exit)",
                    generated)
    log.info("effective config: %s", json.dumps(settings.redacted_dump(), sort_keys=True))
    try:
        serve(settings, getattr(args, "workers", 1) or 1)
    finally:
        for sock in sockets:
            sock.close()
        if generated is not None:
            generated.unlink(missing_ok=True)
    return 0


def _log_setup(settings: Settings) -> None:
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    access_log.configure(settings.server.access_log)


def one_line(exc: BaseException) -> str:
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


def bind_listeners(settings: Settings) -> tuple[Settings, list[socket.socket]]:
    """Reserve the main port (and the admin one when ``admin.port`` is set): a socket bound
    with ``SO_REUSEPORT`` and never listening, kept for the life of the process, so a port 0
    becomes the one the kernel chose and the listeners (``gateway.server``, in this process
    or in every ``--workers`` child) bind it too. The settings returned carry the ports."""
    sockets = [_reserve(settings.host, settings.port)]
    update: dict[str, Any] = {"port": sockets[0].getsockname()[1]}
    admin = settings.admin
    if admin.port is not None:
        try:
            sockets.append(_reserve(admin.host or settings.host, admin.port))
        except OSError:
            sockets[0].close()
            raise
        update["admin"] = admin.model_copy(update={"port": sockets[1].getsockname()[1]})
    return settings.model_copy(update=update), sockets


def _reserve(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        _check_free(host, sock.getsockname()[1])
    except OSError:
        sock.close()
        raise
    return sock


def _check_free(host: str, port: int) -> None:
    """Raise EADDRINUSE when something already listens on the port (``SO_REUSEPORT`` would
    let the listeners share it with another process of this user)."""
    probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        target = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        if probe.connect_ex((target, port)) == 0:
            raise OSError(errno.EADDRINUSE, "address already in use")
    finally:
        probe.close()


def connection_limit(settings: Settings) -> int:
    """``server.max_connections`` clamped below the open-file limit, which is raised to its
    hard maximum first if needed: soft limit - upstream pool - ``FD_MARGIN``."""
    wanted = settings.server.max_connections
    need = wanted + settings.upstream.max_connections + FD_MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit to %d: %s", target, exc)
    if soft == resource.RLIM_INFINITY:
        return wanted
    limit = max(1, min(wanted, soft - settings.upstream.max_connections - FD_MARGIN))
    if limit < wanted:
        log.warning("server.max_connections %d clamped to %d (open-file limit %d)", wanted, limit, soft)
    return limit


class AppFactory:
    """The app of one process, built from the effective settings (with their secrets).

    Picklable: a ``--workers`` child receives it as its process's target (never through
    the environment, where the admin token and the replica API key would be inherited by
    every child process and readable in ``/proc/<pid>/environ``)."""

    def __init__(self, settings: Settings) -> None:
        data = settings.model_dump(mode="json")
        data["admin"]["token"] = settings.admin_token_value()
        key = settings.upstream.replica_api_key  # SecretStr: model_dump masks it
        data["upstream"]["replica_api_key"] = key.get_secret_value() if key is not None else None
        self.settings_json = json.dumps(data)

    def settings(self) -> Settings:
        return Settings.model_validate(json.loads(self.settings_json))

    def run(self) -> None:
        """Serve in this process until SIGTERM (a ``--workers`` child's target too)."""
        from gateway.app import create_app
        from gateway.server import Edge, EdgeApp, serve

        settings = self.settings()
        if not logging.getLogger().handlers:  # a --workers child: a fresh interpreter
            _log_setup(settings)
        fastapi_app = create_app(settings)
        edge = Edge(settings.server)
        edge.admin_port = settings.admin.port
        app = EdgeApp(InferenceFastPath(fastapi_app), edge)

        @contextlib.asynccontextmanager
        async def lifespan() -> AsyncIterator[GatewayMetrics]:
            async with fastapi_app.router.lifespan_context(fastapi_app):
                gc.freeze()
                metrics: GatewayMetrics = fastapi_app.state.gateway.metrics
                yield metrics

        listeners = [(settings.host, settings.port)]
        if settings.admin.port is not None:
            listeners.append((settings.admin.host or settings.host, settings.admin.port))
        run_loop(serve(app, lifespan, listeners))


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """``main`` on uvloop when it is installed, else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def serve(settings: Settings, workers: int) -> None:
    """Run the gateway: in this process, or in ``workers`` children on the same ports."""
    admin = f", admin API on {settings.admin.host or settings.host}:{settings.admin.port}" \
        if settings.admin.port is not None else ""
    log.info("kvgate serve: listening on http://%s:%d%s, %d worker(s)", settings.host, settings.port, admin, workers)
    server = settings.server.model_copy(update={"max_connections": connection_limit(settings)})
    factory = AppFactory(settings.model_copy(update={"server": server}))
    if workers == 1:
        factory.run()
        return
    if not settings.index.redis_url:
        log.warning("%d workers without --redis-url: each worker routes with its own prefix index", workers)
    Workers(factory, workers).run()


class Workers:
    """``--workers N``: N gateway processes on the same ports (the kernel spreads the
    connections, ``SO_REUSEPORT``). SIGTERM and SIGINT go on to every child, which shuts
    down gracefully; a child that dies otherwise is restarted."""

    def __init__(self, factory: AppFactory, count: int) -> None:
        self.factory = factory
        self.count = count
        self.context = multiprocessing.get_context("spawn")
        self.stopping = False
        self.processes: list[multiprocessing.process.BaseProcess] = []

    def _start(self) -> multiprocessing.process.BaseProcess:
        process = self.context.Process(target=self.factory.run, name="kvgate-worker")
        process.start()
        return process

    def _stop(self, signum: int, frame: object) -> None:
        self.stopping = True
        for process in self.processes:
            if process.pid is not None and process.is_alive():
                os.kill(process.pid, signum)

    def run(self) -> None:
        previous = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.processes = [self._start() for _ in range(self.count)]
            while not self.stopping:
                for i, process in enumerate(self.processes):
                    process.join(timeout=0.5 / self.count)
                    if process.exitcode is not None and not self.stopping:
                        log.warning("worker %s exited with %s: restarting it", process.pid, process.exitcode)
                        self.processes[i] = self._start()
            for process in self.processes:
                process.join()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
