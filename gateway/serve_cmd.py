"""`kvgate serve`: run the gateway (FastAPI on uvicorn).

Every flag is a shortcut for one settings field (``FLAG_FIELDS``); ``--set a.b=v`` sets
any other field (the value is parsed as JSON when it parses, else taken as a string).
Flags override the environment (``KVGATE_...``), which overrides ``--config``.

Server: uvicorn on uvloop with the gateway's own httptools protocol and server
(``gateway/server.py``: idle/header/body deadlines, connection and concurrency caps,
graceful shutdown), access log off. The listeners are bound here first (the main one,
and ``admin.port``'s when set), then the admin token is resolved (``admin.token``, or
``admin.token_file``, or generated into a 0600 file whose path is logged and which is
removed at exit). ``--workers N`` runs N gateway processes on those sockets (uvicorn's
supervisor; each child builds its own app and server from the same settings, handed to
it inside the pickled process object over multiprocessing's pipe: ``EdgeAppFactory``,
never through the environment, where the admin token and the replica API key would be
inherited by every child process and readable in ``/proc/<pid>/environ``). Workers share routing state only through Redis
(``--redis-url``): without it each has its own prefix index, and affinity is per worker.

A bad configuration (file syntax, a field's value, an unreadable token file) is one
line on stderr, ``kvgate serve: config file X, line N: field a.b: ...``, exit 2.

Garbage collection: the objects alive at start-up (FastAPI, pydantic, prometheus, the
policy: ~10^5 objects) are moved out of the collector's reach (``gc.freeze``), so the
full collections that a 400 KB body's thousands of parsed objects trigger now and then
scan only what requests allocate (they were the 400 KB request's p99: +30 ms).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.server import Server
from uvicorn.supervisors.multiprocess import Multiprocess, Process

from gateway import access_log
from gateway.edge import Edge, EdgeProtocol, connection_limit
from gateway.server import EdgeApp, GatewayServer
from gateway.settings import Settings, load_settings, set_path

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.types import Receive, Scope, Send

log = logging.getLogger("kvgate.serve")

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
    # uvicorn re-raises the SIGTERM it caught once it has shut down: exit through this
    # handler (status 143, as a signal death would) so the ``finally`` below still runs
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        serve(settings, sockets, getattr(args, "workers", 1) or 1)
    finally:
        if generated is not None:
            generated.unlink(missing_ok=True)
    return 0


def _log_setup(settings: Settings) -> None:
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    access_log.configure(settings.server.access_log)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def one_line(exc: BaseException) -> str:
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


def bind_listeners(settings: Settings) -> tuple[Settings, list[socket.socket]]:
    """Bind the main listener (and the admin one when ``admin.port`` is set); the settings
    returned carry the bound ports (a port 0 becomes the one the kernel chose)."""
    sockets = [_bind(settings.host, settings.port)]
    update: dict[str, Any] = {"port": sockets[0].getsockname()[1]}
    admin = settings.admin
    if admin.port is not None:
        try:
            sockets.append(_bind(admin.host or settings.host, admin.port))
        except OSError:
            sockets[0].close()
            raise
        update["admin"] = admin.model_copy(update={"port": sockets[1].getsockname()[1]})
    return settings.model_copy(update=update), sockets


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def uvicorn_config(app: Any, settings: Settings, workers: int, factory: bool = False) -> uvicorn.Config:
    server = settings.server
    return uvicorn.Config(app, factory=factory, workers=workers, log_level=settings.log_level,
                          access_log=False, timeout_keep_alive=int(max(1.0, server.keep_alive_timeout_s)),
                          timeout_graceful_shutdown=int(server.shutdown_grace_s), loop="uvloop",
                          http=EdgeProtocol, ws="none", limit_concurrency=None, proxy_headers=False)


def gateway_server(config: uvicorn.Config, settings: Settings) -> GatewayServer:
    edge = Edge(settings.server, connection_limit(settings))
    edge.admin_port = settings.admin.port
    return GatewayServer(config, edge)


class EdgeAppFactory:
    """The app of one process, built from the effective settings (with their secrets).

    Picklable: a ``--workers`` child receives it inside its uvicorn config (uvicorn's
    factory mode calls it there); the single process calls it directly.
    """

    def __init__(self, settings: Settings) -> None:
        data = settings.model_dump(mode="json")
        data["admin"]["token"] = settings.admin_token_value()
        key = settings.upstream.replica_api_key  # SecretStr: model_dump masks it
        data["upstream"]["replica_api_key"] = key.get_secret_value() if key is not None else None
        self.settings_json = json.dumps(data)

    def settings(self) -> Settings:
        return Settings.model_validate(json.loads(self.settings_json))

    def __call__(self) -> EdgeApp:
        from gateway.app import create_app
        from gateway.callback_path import CallbackPath

        settings = self.settings()
        if not logging.getLogger().handlers:  # a --workers child: a fresh interpreter
            _log_setup(settings)
        fastapi_app = create_app(settings)
        app = EdgeApp(InferenceFastPath(fastapi_app), lambda: fastapi_app.state.gateway.metrics,
                      lambda: CallbackPath.of(fastapi_app.state.gateway))
        gc.freeze()
        return app


def serve(settings: Settings, sockets: list[socket.socket], workers: int) -> None:
    """Run the gateway on ``sockets``: in this process, or in ``workers`` children."""
    factory = EdgeAppFactory(settings)
    admin = f", admin API on {settings.admin.host or settings.host}:{settings.admin.port}" \
        if settings.admin.port is not None else ""
    log.info("kvgate serve: listening on http://%s:%d%s, %d worker(s)", settings.host, settings.port, admin, workers)
    if workers > 1:
        if not settings.index.redis_url:
            log.warning("%d workers without --redis-url: each worker routes with its own prefix index", workers)
        config = uvicorn_config(factory, settings, workers, factory=True)
        Workers(config, sockets=sockets).run()
        return
    gateway_server(uvicorn_config(factory(), settings, 1), settings).run(sockets=sockets)


class WorkerProcess(Process):
    """A ``--workers`` child running the gateway's own server (settings from the parent)."""

    @property
    def server(self) -> Server:
        if self._server is None:
            factory = self.config.app
            assert isinstance(factory, EdgeAppFactory)
            self._server = gateway_server(self.config, factory.settings())
        return self._server

    def target(self, sockets: list[socket.socket] | None = None) -> None:  # pragma: no cover (child)
        assert self.server is not None  # built before uvicorn's health-check thread reads it
        super().target(sockets)


class Workers(Multiprocess):
    """uvicorn's supervisor, starting ``WorkerProcess`` children (also when it restarts one)."""

    def init_processes(self) -> None:
        for _ in range(self.processes_num):
            process = WorkerProcess(self.config, self.sockets)
            process.start()
            self.processes.append(process)

    def keep_subprocess_alive(self) -> None:
        if self.should_exit.is_set():
            return
        for idx, process in enumerate(self.processes):
            if process.is_alive(timeout=self.config.timeout_worker_healthcheck):
                continue
            process.kill()
            process.join()
            if process.exitcode == STARTUP_FAILURE or self.should_exit.is_set():
                log.error("worker [%s] failed to start: stopping", process.pid)
                self.should_exit.set()
                return
            log.info("worker [%s] died: restarting it", process.pid)
            self.processes[idx] = WorkerProcess(self.config, self.sockets)
            self.processes[idx].start()

    def restart_all(self) -> None:  # SIGHUP: replace the workers one by one
        for idx, old in enumerate(self.processes):
            if self.should_exit.is_set():
                return
            new = WorkerProcess(self.config, self.sockets)
            new.start()
            if not new.wait_until_ready(self.config.timeout_worker_healthcheck, self.should_exit):
                new.kill()
                new.join()
                return
            old.terminate()
            old.join()
            self.processes[idx] = new
