"""The admin API under ``/admin/``: list, add, remove, drain and undrain replicas; config.

    GET    /admin/replicas                  every replica: state, load, capacity
    POST   /admin/replicas          {"url"}  add (joins once its probes pass)
    DELETE /admin/replicas?url=U             remove now (requests in flight finish)
    POST   /admin/replicas/drain    {"url", "deadline_s"?, "wait"?}
                                             stop new requests; removed when empty or at
                                             the deadline; "wait": answer once removed
    POST   /admin/replicas/undrain  {"url"}  back to routable
    GET    /admin/config                     effective configuration, secrets redacted
    GET    /admin/scale                      scale advice now: desired replicas per model,
                                             ranking coldest first with cache value, candidate
    POST   /admin/scale/prepare-removal {"count", "model"?}
                                             mark the N coldest active replicas (of one
                                             model's group, else of the fleet) as removal
                                             candidates (no new sessions, sessions move on
                                             their next turn); 0 clears; unknown model: 404

Every call needs ``Authorization: Bearer <token>`` (``admin.token``; ``kvgate serve``
always has one: configured, read from ``admin.token_file``, or generated at start-up by
``resolve_admin_token``): none -> 401, a wrong one -> 403, compared in constant time.
Input is validated: a replica URL is parsed (``http``/``https``, a host name or IP
address, a valid port, no userinfo, no whitespace or control characters; no link-local
or cloud metadata address unless ``registry.allow_link_local_replicas``), else 400 with
``param``. A replica is known by its canonical URL (``replicas.urls``): adding another
spelling of a known replica returns it (one entry), and remove / drain / undrain find
it by any spelling. Unknown replicas -> 404. Every call is counted in ``kvgate_admin_requests``
(route template, status).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Protocol

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field, SecretStr
from starlette.responses import Response

from gateway.errors import Forbidden, GatewayError, InvalidRequest, NotFound, Unauthorized
from gateway.kv_wiring import PreciseMode
from gateway.metrics import GatewayMetrics
from gateway.relay import json_response
from gateway.scaling import ScaleLoop, UnknownGroup, report_json
from gateway.settings import ConfigError, Settings
from prefix_index.base import ReplicaId
from replicas.model import ReplicaView
from replicas.registry import Registry
from replicas.urls import MAX_URL_CHARS, ReplicaUrlError, parse_replica_url


class AdminGateway(Protocol):
    """What the admin API uses of the gateway (``app.state.gateway``, a ``gateway.app.Gateway``)."""

    settings: Settings
    registry: Registry
    scaling: ScaleLoop
    metrics: GatewayMetrics
    precise: PreciseMode | None

log = logging.getLogger("kvgate.admin")

WAIT_POLL_S = 0.05
WAIT_MARGIN_S = 5.0  # beyond the drain deadline, for the registry's drain check to run
MAX_DEADLINE_S = 7 * 86400.0


def _gateway(request: Request) -> AdminGateway:
    gateway: AdminGateway = request.app.state.gateway
    return gateway


def require_admin(request: Request) -> None:
    token = _gateway(request).settings.admin_token_value()
    header = request.headers.get("authorization")
    if not header:
        raise Unauthorized("admin API needs 'Authorization: Bearer <token>'")
    scheme, _, given = header.partition(" ")
    if token is None:  # no credential configured (kvgate serve always has one): locked
        raise Forbidden("admin API has no token configured")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), token.encode()):
        raise Forbidden("wrong admin token")


class CountedRoute(APIRoute):
    """An admin route that counts its calls in ``kvgate_admin_requests`` (route, status)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        route = self.path

        async def counted(request: Request) -> Response:
            status = 500
            try:
                response = await handler(request)
                status = response.status_code
                return response
            except GatewayError as exc:
                status = exc.status
                raise
            except RequestValidationError:
                status = 400
                raise
            finally:
                gateway = getattr(request.app.state, "gateway", None)
                if gateway is not None:
                    gateway.metrics.admin_requests.labels(route=route, status=str(status)).inc()

        return counted


router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], route_class=CountedRoute)


def validate_replica_url(url: str, *, allow_link_local: bool = False) -> ReplicaId:
    """The canonical id of ``url`` if it is a usable replica base URL (``replicas.urls``),
    else ``InvalidRequest`` with the reason (link-local and metadata addresses included,
    unless ``registry.allow_link_local_replicas``)."""
    try:
        return parse_replica_url(url, allow_link_local=allow_link_local)
    except ReplicaUrlError as exc:
        raise InvalidRequest(f"url: {exc}", param="url") from None


def replica_id(url: str) -> ReplicaId:
    """The registry id ``url`` names, in any spelling: its canonical form, or ``url``
    itself when it does not parse (an id the registry got some other way, e.g. from
    shared state written by an older gateway, can still be removed or drained)."""
    try:
        return parse_replica_url(url, allow_link_local=True)  # a lookup adds nothing: no policy here
    except ReplicaUrlError:
        return ReplicaId(url)


class ReplicaRef(BaseModel):
    url: str = Field(min_length=1, max_length=MAX_URL_CHARS, description="replica base URL, http(s)://host:port")


class DrainRequest(ReplicaRef):
    deadline_s: float | None = Field(default=None, ge=0, le=MAX_DEADLINE_S, allow_inf_nan=False,
                                     description="remove at the latest after this long")
    wait: bool = Field(default=False, description="answer only once the replica is removed")


def view_json(view: ReplicaView, now_s: float) -> dict[str, Any]:
    """A replica as the admin API shows it; ``now_s`` on the registry's clock (its drain
    deadlines are on that clock)."""
    data = dataclasses.asdict(view)
    data["state"] = view.state.value
    data["url"] = view.id
    data["routable"] = view.routable
    data["memory_bound"] = view.memory_bound  # prefill admission holds nothing for it
    data["models"] = sorted(view.models)
    if view.drain_deadline_s is not None:
        data["drain_remaining_s"] = max(0.0, view.drain_deadline_s - now_s)
    return data


def registry_now(gateway: AdminGateway) -> float:
    """Now on the registry's clock (``drain_deadline_s`` is on it)."""
    return gateway.registry.now()


def _known(gateway: AdminGateway, url: str) -> ReplicaView:
    """The replica ``url`` names in any spelling (``replica_id``), else 404."""
    view = gateway.registry.get(replica_id(url))
    if view is None:
        view = gateway.registry.get(url)
    if view is None:
        raise NotFound(f"unknown replica {url!r}", param="url")
    return view


@router.get("/replicas")
async def list_replicas(request: Request) -> Response:
    gateway = _gateway(request)
    now_s = registry_now(gateway)
    precise = gateway.precise
    data = [view_json(v, now_s) for v in gateway.registry.views()]
    for item in data:  # precise mode per replica (issue 42): its state, or why it is approximate
        item["precise"] = precise.replica_status(ReplicaId(item["url"])) if precise is not None else None
    return json_response({"object": "list", "data": data})


@router.post("/replicas")
async def add_replica(ref: ReplicaRef, request: Request) -> Response:
    gateway = _gateway(request)
    allow = gateway.settings.registry.allow_link_local_replicas
    view = await gateway.registry.add(validate_replica_url(ref.url, allow_link_local=allow))
    return json_response(view_json(view, registry_now(gateway)), 201)


@router.delete("/replicas")
async def remove_replica(url: str, request: Request) -> Response:
    gateway = _gateway(request)
    view = _known(gateway, url)
    await gateway.registry.remove(view.id)
    return json_response({"removed": view.id})


@router.post("/replicas/drain")
async def drain_replica(body: DrainRequest, request: Request) -> Response:
    gateway = _gateway(request)
    rid = _known(gateway, body.url).id
    view = await gateway.registry.drain(rid, body.deadline_s)
    if not body.wait:
        return json_response(view_json(view, registry_now(gateway)))
    deadline_s = body.deadline_s if body.deadline_s is not None else gateway.settings.registry.drain_timeout_s
    removed = await _wait_removed(gateway, rid, deadline_s + WAIT_MARGIN_S)
    current = gateway.registry.get(rid)
    return json_response({"url": view.id, "removed": removed,
                          "replica": None if current is None else view_json(current, registry_now(gateway))})


async def _wait_removed(gateway: AdminGateway, url: str, timeout_s: float) -> bool:
    """True once the replica left the registry; False if it is still there at the timeout
    (or was undrained / re-added as a new member)."""
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                view = gateway.registry.get(url)
                if view is None or view.state.value == "removed":
                    return True
                if view.state.value != "draining":
                    return False
                await asyncio.sleep(WAIT_POLL_S)
    except TimeoutError:
        return False


@router.post("/replicas/undrain")
async def undrain_replica(ref: ReplicaRef, request: Request) -> Response:
    gateway = _gateway(request)
    rid = _known(gateway, ref.url).id
    return json_response(view_json(await gateway.registry.undrain(rid), registry_now(gateway)))


@router.get("/config")
async def config(request: Request) -> Response:
    return json_response(_gateway(request).settings.redacted_dump())


class PrepareRemoval(BaseModel):
    count: int = Field(ge=0, le=100_000, description="how many of the coldest active replicas to mark (0: clear)")
    model: str | None = Field(default=None, max_length=1024,
                              description="only this model's replicas (a key of GET /admin/scale's models)")


@router.get("/scale")
async def scale(request: Request) -> Response:
    report = await _gateway(request).scaling.evaluate()
    return json_response(report_json(report))


@router.post("/scale/prepare-removal")
async def prepare_removal(body: PrepareRemoval, request: Request) -> Response:
    try:
        report = await _gateway(request).scaling.prepare_removal(body.count, body.model)
    except UnknownGroup:
        raise NotFound(f"no replica serves model {body.model!r}", param="model") from None
    return json_response(report_json(report))


def default_token_dir() -> Path:
    """``$XDG_RUNTIME_DIR/kvgate`` (a per-user tmpfs), else ``~/.cache/kvgate``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "kvgate" if runtime else Path.home() / ".cache" / "kvgate"


def resolve_admin_token(settings: Settings, port: int) -> tuple[Settings, Path | None]:
    """The settings with ``admin.token`` set, and the file of a generated token (or None).

    A configured token is kept; else ``admin.token_file`` is read (surrounding whitespace
    stripped); else a random token is generated and written, mode 0600, to
    ``admin.generated_token_dir`` (default ``default_token_dir()``) as
    ``admin-token-<port>``. The token itself is never logged. ``ConfigError`` when the
    file cannot be read or written or is empty."""
    admin = settings.admin
    generated: Path | None = None
    if admin.token is not None and admin.token.get_secret_value().strip():
        return settings, None
    if admin.token_file is not None:
        try:
            token = admin.token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"admin.token_file {admin.token_file}: {getattr(exc, 'strerror', None) or exc}") \
                from None
        if not token:
            raise ConfigError(f"admin.token_file {admin.token_file}: empty")
    else:
        token = secrets.token_urlsafe(32)
        generated = (admin.generated_token_dir or default_token_dir()) / f"admin-token-{port}"
        try:
            _write_private(generated, token)
        except OSError as exc:
            raise ConfigError(f"admin.generated_token_dir: cannot write {generated}: {exc.strerror or exc}") \
                from None
    update = {"admin": admin.model_copy(update={"token": SecretStr(token)})}
    return settings.model_copy(update=update), generated


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by the owner only (created 0600, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode() + b"\n")
    finally:
        os.close(fd)
    os.replace(tmp, path)
