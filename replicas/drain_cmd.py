"""`kvgate drain`: ask the gateway(s) to drain a replica and wait until it is idle (preStop hook).

    kvgate drain --gateway http://kvgate:8000 --replica http://10.1.2.3:30000 --wait --timeout-s 840

1. ``POST /admin/replicas/drain {"url", "deadline_s"}`` on every gateway (``--gateway`` may
   be repeated; ``--all-addresses`` expands each gateway host to all its DNS addresses,
   so a headless Service of the gateway reaches every gateway pod). A gateway that does
   not know the replica (404) or cannot be reached is reported and skipped.
2. With ``--wait``: poll until the replica is idle, bounded by ``--timeout-s``:
   - each gateway's ``GET /admin/replicas``: the replica's ``in_flight`` is 0, or it is no
     longer listed (the registry removes a drained replica by itself);
   - the replica's own ``GET /v1/loads``: ``num_running_reqs + num_waiting_reqs == 0``
     summed over DP ranks (this also covers clients that bypass the gateways). A replica
     that does not answer has nothing in flight to lose.
3. ``--done-file PATH`` is written at the end (success or timeout), for a preStop hook
   in another container of the pod that waits for it (deploy/README.md, "Drain").

Exit 0 when drained (or without ``--wait`` when every reachable gateway accepted the
drain), 1 on timeout, 2 when no gateway accepted and ``--wait`` was not given (or the
token file cannot be read). The admin token (the admin API always needs one) comes from
``--admin-token`` (default ``$KVGATE_ADMIN_TOKEN``, else ``$KVGATE_ADMIN__TOKEN``, the
gateway's own variable), else from the file ``--admin-token-file`` (default
``$KVGATE_ADMIN_TOKEN_FILE`` / ``$KVGATE_ADMIN__TOKEN_FILE``; a mounted Secret).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from replicas.discovery import replica_url, resolve_addresses

log = logging.getLogger("kvgate.drain")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gateway", action="append", required=True, help="gateway base URL (repeatable)")
    parser.add_argument("--replica", required=True, help="replica URL as the gateways know it")
    parser.add_argument("--wait", action="store_true", help="wait until the replica has nothing in flight")
    parser.add_argument("--timeout-s", type=float, default=840.0, help="bound on the whole command")
    parser.add_argument("--poll-interval-s", type=float, default=1.0)
    parser.add_argument("--admin-token", default=_env("KVGATE_ADMIN_TOKEN", "KVGATE_ADMIN__TOKEN"),
                        help="bearer token of the admin API (default: $KVGATE_ADMIN_TOKEN)")
    parser.add_argument("--admin-token-file", type=Path,
                        default=_env("KVGATE_ADMIN_TOKEN_FILE", "KVGATE_ADMIN__TOKEN_FILE"),
                        help="read the token from this file when --admin-token is not given "
                        "(default: $KVGATE_ADMIN_TOKEN_FILE)")
    parser.add_argument("--all-addresses", action="store_true",
                        help="call every address a gateway host resolves to (headless Service)")
    parser.add_argument("--no-replica-loads", dest="replica_loads", action="store_false",
                        help="do not poll the replica's /v1/loads")
    parser.add_argument("--done-file", type=Path, help="write this file when finished")


def _env(*names: str) -> str | None:
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


def admin_token(args: argparse.Namespace) -> str | None:
    """``--admin-token``, else the stripped content of ``--admin-token-file`` (OSError if unreadable)."""
    if args.admin_token:
        return str(args.admin_token)
    path = getattr(args, "admin_token_file", None)
    if not path:
        return None
    return Path(path).read_text(encoding="utf-8").strip() or None


async def expand_gateways(gateways: list[str], all_addresses: bool) -> list[str]:
    if not all_addresses:
        return [g.rstrip("/") for g in gateways]
    out: list[str] = []
    for g in gateways:
        url = httpx.URL(g)
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            addresses = sorted(await resolve_addresses(url.host, port))
        except (OSError, UnicodeError) as e:
            log.warning("cannot resolve %s (%s); using it as is", url.host, e)
            addresses = []
        out.extend(replica_url(a, port, url.scheme) for a in addresses)
        if not addresses:
            out.append(g.rstrip("/"))
    return out


async def request_drain(client: httpx.AsyncClient, gateway: str, replica: str, deadline_s: float,
                        headers: dict[str, str]) -> bool:
    try:
        r = await client.post(f"{gateway}/admin/replicas/drain", json={"url": replica, "deadline_s": deadline_s},
                              headers=headers)
    except httpx.HTTPError as e:
        log.warning("gateway %s unreachable: %s", gateway, e)
        return False
    if r.status_code == 404:
        log.info("gateway %s does not know %s", gateway, replica)
        return False
    if r.is_error:
        log.warning("gateway %s refused the drain: %s %s", gateway, r.status_code, r.text[:200])
        return False
    log.info("gateway %s draining %s", gateway, replica)
    return True


async def gateway_in_flight(client: httpx.AsyncClient, gateway: str, replica: str, headers: dict[str, str]) -> int:
    """In-flight count the gateway reports for the replica (0 when unlisted or unreachable)."""
    try:
        r = await client.get(f"{gateway}/admin/replicas", headers=headers)
        r.raise_for_status()
        body: Any = r.json()
    except (httpx.HTTPError, ValueError) as e:
        log.warning("gateway %s: cannot read replicas (%s)", gateway, e)
        return 0
    # {"object": "list", "data": [...]} (the admin API); a bare list is accepted too
    rows: list[dict[str, Any]] = (body.get("data") or body.get("replicas") or []) if isinstance(body, dict) else body
    want = replica.rstrip("/")
    return sum(int(row.get("in_flight", 0)) for row in rows if str(row.get("url", "")).rstrip("/") == want)


async def replica_busy(client: httpx.AsyncClient, replica: str) -> int:
    """Running + waiting requests the replica reports on /v1/loads (0 if it does not answer)."""
    try:
        r = await client.get(f"{replica.rstrip('/')}/v1/loads", params={"include": "core"})
        r.raise_for_status()
        loads = r.json().get("loads") or []
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        log.info("replica %s: no load report (%s)", replica, e)
        return 0
    return sum(int(x.get("num_running_reqs", 0)) + int(x.get("num_waiting_reqs", 0)) for x in loads)


async def drain(args: argparse.Namespace, client: httpx.AsyncClient) -> int:
    deadline = time.monotonic() + args.timeout_s
    token = admin_token(args)
    headers = {"Authorization": f"Bearer {token}"} if token else {}  # gateways only
    gateways = await expand_gateways(args.gateway, args.all_addresses)
    accepted = await asyncio.gather(*(request_drain(client, g, args.replica, args.timeout_s, headers) for g in gateways))
    if not args.wait:
        return 0 if any(accepted) else 2
    while True:
        counts = await asyncio.gather(*(gateway_in_flight(client, g, args.replica, headers) for g in gateways))
        busy = sum(counts) + (await replica_busy(client, args.replica) if args.replica_loads else 0)
        if busy == 0:
            log.info("replica %s drained", args.replica)
            return 0
        left = deadline - time.monotonic()
        if left <= 0:
            log.warning("replica %s still has %d requests after %.0fs", args.replica, busy, args.timeout_s)
            return 1
        await asyncio.sleep(min(args.poll_interval_s, left))


async def main_async(args: argparse.Namespace, transport: httpx.AsyncBaseTransport | None = None) -> int:
    timeout = httpx.Timeout(min(10.0, max(1.0, args.timeout_s)))
    try:
        async with httpx.AsyncClient(timeout=timeout, transport=transport) as client:
            return await drain(args, client)
    finally:
        if args.done_file is not None:
            args.done_file.parent.mkdir(parents=True, exist_ok=True)
            args.done_file.write_text(f"{socket.gethostname()} {time.time():.0f}\n")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="kvgate drain: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll is noise in pod events
    try:
        admin_token(args)
    except (OSError, UnicodeDecodeError) as exc:
        print(f"kvgate drain: --admin-token-file {args.admin_token_file}: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(main_async(args))
