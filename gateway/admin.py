"""The admin API under ``/admin/``: list, add, remove, drain and undrain replicas; config.

    GET    /admin/replicas                  every replica: state, load, capacity
    POST   /admin/replicas          {"url"}  add (joins once its probes pass)
    DELETE /admin/replicas?url=U             remove now (requests in flight finish)
    POST   /admin/replicas/drain    {"url", "deadline_s"?, "wait"?}
                                             stop new requests; removed when empty or at
                                             the deadline; "wait": answer once removed
    POST   /admin/replicas/undrain  {"url"}  back to routable
    GET    /admin/config                     effective configuration, secrets redacted
    GET    /admin/scale                      scale advice now: desired replicas, ranking
                                             coldest first with cache value, candidate
    POST   /admin/scale/prepare-removal {"count"}
                                             mark the N coldest active replicas as removal
                                             candidates (no new sessions, sessions move on
                                             their next turn); 0 clears

When ``admin_token`` is set every call needs ``Authorization: Bearer <token>``: none
-> 401, a wrong one -> 403 (OpenAI-shaped bodies). Unknown replicas -> 404.
"""
from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field
from starlette.responses import Response

from gateway.errors import Forbidden, InvalidRequest, NotFound, Unauthorized
from gateway.proxy import json_response
from gateway.scaling import report_json
from replicas.model import ReplicaView

if TYPE_CHECKING:
    from gateway.app import Gateway

WAIT_POLL_S = 0.05
WAIT_MARGIN_S = 5.0  # beyond the drain deadline, for the registry's drain check to run


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def require_admin(request: Request) -> None:
    token = _gateway(request).settings.admin_token_value()
    if token is None:
        return
    header = request.headers.get("authorization")
    if not header:
        raise Unauthorized("admin API needs 'Authorization: Bearer <token>'")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), token.encode()):
        raise Forbidden("wrong admin token")


router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


class ReplicaRef(BaseModel):
    url: str = Field(min_length=1)


class DrainRequest(ReplicaRef):
    deadline_s: float | None = Field(default=None, ge=0, description="remove at the latest after this long")
    wait: bool = Field(default=False, description="answer only once the replica is removed")


def view_json(view: ReplicaView) -> dict[str, Any]:
    data = dataclasses.asdict(view)
    data["state"] = view.state.value
    data["url"] = view.id
    data["routable"] = view.routable
    if view.drain_deadline_s is not None:
        data["drain_remaining_s"] = max(0.0, view.drain_deadline_s - time.monotonic())
    return data


def _known(gateway: Gateway, url: str) -> ReplicaView:
    view = gateway.registry.get(url)
    if view is None:
        raise NotFound(f"unknown replica {url!r}", param="url")
    return view


@router.get("/replicas")
async def list_replicas(request: Request) -> Response:
    views = _gateway(request).registry.views()
    return json_response({"object": "list", "data": [view_json(v) for v in views]})


@router.post("/replicas")
async def add_replica(ref: ReplicaRef, request: Request) -> Response:
    if not ref.url.startswith(("http://", "https://")):
        raise InvalidRequest("url must start with http:// or https://", param="url")
    view = await _gateway(request).registry.add(ref.url)
    return json_response(view_json(view), 201)


@router.delete("/replicas")
async def remove_replica(url: str, request: Request) -> Response:
    gateway = _gateway(request)
    view = _known(gateway, url)
    await gateway.registry.remove(url)
    return json_response({"removed": view.id})


@router.post("/replicas/drain")
async def drain_replica(body: DrainRequest, request: Request) -> Response:
    gateway = _gateway(request)
    _known(gateway, body.url)
    view = await gateway.registry.drain(body.url, body.deadline_s)
    if not body.wait:
        return json_response(view_json(view))
    deadline_s = body.deadline_s if body.deadline_s is not None else gateway.settings.registry.drain_timeout_s
    removed = await _wait_removed(gateway, body.url, deadline_s + WAIT_MARGIN_S)
    current = gateway.registry.get(body.url)
    return json_response({"url": view.id, "removed": removed,
                  "replica": None if current is None else view_json(current)})


async def _wait_removed(gateway: Gateway, url: str, timeout_s: float) -> bool:
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
    _known(gateway, ref.url)
    return json_response(view_json(await gateway.registry.undrain(ref.url)))


@router.get("/config")
async def config(request: Request) -> Response:
    return json_response(_gateway(request).settings.redacted_dump())


class PrepareRemoval(BaseModel):
    count: int = Field(ge=0, description="how many of the coldest active replicas to mark (0: clear)")


@router.get("/scale")
async def scale(request: Request) -> Response:
    report = await _gateway(request).scaling.evaluate()
    return json_response(report_json(report))


@router.post("/scale/prepare-removal")
async def prepare_removal(body: PrepareRemoval, request: Request) -> Response:
    report = await _gateway(request).scaling.prepare_removal(body.count)
    return json_response(report_json(report))
