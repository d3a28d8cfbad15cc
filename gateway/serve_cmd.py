"""`kvgate serve`: run the gateway (FastAPI on uvicorn).

Every flag is a shortcut for one settings field (``FLAG_FIELDS``); ``--set a.b=v`` sets
any other field (the value is parsed as JSON when it parses, else taken as a string).
Flags override the environment (``KVGATE_...``), which overrides ``--config``.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from gateway.settings import Settings, load_settings, set_path

log = logging.getLogger("kvgate.serve")

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
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                access_log=settings.log_level == "debug", timeout_graceful_shutdown=30)
    return 0
