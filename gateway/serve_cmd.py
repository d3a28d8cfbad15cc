"""`kvgate serve`: run the gateway (FastAPI on uvicorn).

Every flag is a shortcut for one settings field (``FLAG_FIELDS``); ``--set a.b=v`` sets
any other field (the value is parsed as JSON when it parses, else taken as a string).
Flags override the environment (``KVGATE_...``), which overrides ``--config``.

Server: uvicorn with uvloop and httptools when installed (``uvicorn[standard]``; the
pure-Python h11 parser and asyncio loop cost the gateway measurably more CPU per
request), access log off. ``--workers N`` runs N gateway processes on one port (uvicorn
forks them; each builds its own app from the same settings, passed to the children as
JSON in ``KVGATE_SERVE_SETTINGS_JSON``). Workers share routing state only through Redis
(``--redis-url``): without it each has its own prefix index, and affinity is per worker.

Garbage collection: the objects alive at start-up (FastAPI, pydantic, prometheus, the
policy: ~10^5 objects) are moved out of the collector's reach (``gc.freeze``), so the
full collections that a 400 KB body's thousands of parsed objects trigger now and then
scan only what requests allocate (they were the 400 KB request's p99: +30 ms).
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.settings import Settings, load_settings, set_path

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.types import Receive, Scope, Send

log = logging.getLogger("kvgate.serve")
SETTINGS_ENV = "KVGATE_SERVE_SETTINGS_JSON"  # settings handed to --workers children

# flag dest -> settings fields (dotted); flags left unset do not override anything.
# --redis-url is what several gateways share: the prefix index and the replica state.
FLAG_FIELDS: dict[str, tuple[str, ...]] = {
    "host": ("host",),
    "port": ("port",),
    "replica": ("registry.replicas",),
    "policy": ("policy.name",),
    "admin_token": ("admin_token",),
    "redis_url": ("index.redis_url", "registry.shared.redis_url"),
    "log_level": ("log_level",),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="listen address (settings: host; default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (settings: port; default 8000)")
    parser.add_argument("--replica", action="append", metavar="URL",
                        help="replica URL, repeatable (settings: registry.replicas)")
    parser.add_argument("--policy", metavar="NAME", help="routing policy (settings: policy.name)")
    parser.add_argument("--admin-token", metavar="T", help="bearer token for /admin (settings: admin_token)")
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


def server_options() -> dict[str, str]:
    """uvloop and httptools when installed, else uvicorn's pure-Python defaults."""
    def has(module: str) -> bool:
        return importlib.util.find_spec(module) is not None

    return {"loop": "uvloop" if has("uvloop") else "asyncio", "http": "httptools" if has("httptools") else "h11"}


class InferenceFastPath:
    """ASGI front: POSTs to the inference paths go straight to ``Gateway.handle``.

    Skips FastAPI's middleware stack and router (five layers, ~8% of the gateway's CPU on
    a small request); every other request, and the lifespan, goes to the app unchanged."""

    def __init__(self, app: FastAPI) -> None:
        from starlette.requests import Request

        from gateway.app import ENDPOINT_PATHS
        from gateway.errors import GatewayError
        from gateway.proxy import error_response

        self.app = app
        self.endpoints = {path: endpoint for endpoint, path in ENDPOINT_PATHS.items()}
        self.request, self.error, self.error_response = Request, GatewayError, error_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.endpoints.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" \
            else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        try:
            response = await self.app.state.gateway.handle(self.request(scope, receive), endpoint)
        except Exception as exc:  # as the app's own handler: logged, OpenAI-shaped 500
            log.exception("inference request failed")
            response = self.error_response(self.error(f"internal gateway error ({type(exc).__name__})"))
        await response(scope, receive, send)


def app_from_env() -> InferenceFastPath:
    """The app of one ``--workers`` child (uvicorn factory): settings from the parent."""
    from gateway.app import create_app
    from gateway.settings import Settings

    app = InferenceFastPath(create_app(Settings.model_validate(json.loads(os.environ[SETTINGS_ENV]))))
    gc.freeze()
    return app


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app
    from policies.registry import make_policy

    try:
        settings = settings_from_args(args)
        make_policy(settings.policy.name, settings.policy.params, settings.policy.seed)  # typos fail here
    except (ValueError, OSError) as exc:  # pydantic's ValidationError is a ValueError
        print(f"kvgate serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    log.info("effective config: %s", json.dumps(settings.redacted_dump(), sort_keys=True))
    options: dict[str, Any] = dict(host=settings.host, port=settings.port, log_level=settings.log_level,
                                   access_log=False, timeout_graceful_shutdown=30,
                                   timeout_keep_alive=settings.keep_alive_timeout_s, **server_options())
    workers = getattr(args, "workers", 1) or 1
    if workers > 1:
        if not settings.index.redis_url:
            log.warning("%d workers without --redis-url: each worker routes with its own prefix index", workers)
        data = settings.model_dump(mode="json")
        if settings.admin_token is not None:
            data["admin_token"] = settings.admin_token.get_secret_value()
        os.environ[SETTINGS_ENV] = json.dumps(data)
        uvicorn.run("gateway.serve_cmd:app_from_env", factory=True, workers=workers, **options)
    else:
        app = InferenceFastPath(create_app(settings))
        gc.freeze()
        uvicorn.run(app, **options)
    return 0
