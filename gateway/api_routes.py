"""The coding agents' endpoints beside the inference path: Responses ids, count_tokens, models.

``POST /v1/messages`` and ``POST /v1/responses`` are inference endpoints like chat
(``gateway.app.ENDPOINT_PATHS``: parsed once, routed, bodies passed through unchanged).
This module adds what they need around them:

- ``ResponsesApi.pin``: a Responses request naming ``previous_response_id`` goes to the
  replica that created that response (``gateway.responses_store``); the proxy routes it
  with every other replica excluded (reason ``previous-response``) and never retries it
  elsewhere. An id the gateway never saw (or forgot), or whose replica has left the
  fleet: 404 ``previous_response_not_found`` (OpenAI's shape, ``param:
  previous_response_id``). Its replica still registered but not routable (unhealthy,
  draining, ejected): 503 ``previous_response_replica_unavailable``. Never a silent
  answer from a replica without that response.
- ``ResponsesApi.record``: the id of every response created (a JSON body's ``id``, the
  ``response.created`` event at the head of a stream) is stored with the replica.
- ``GET``/``DELETE /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``: sent to that
  replica as they are (404 as above when unknown); a successful DELETE forgets the id.
- ownership (issue 41): the id is recorded with the tenant of the request that created
  it (``gateway.responses_store.Tenants``), and pin, GET, DELETE and cancel by any other
  tenant get the 404 of an id never seen, the very same body: whether an id exists is
  not revealed to a tenant that does not own it. (The body's own ids, ``request_id`` and
  ``rid``, are refused by ``gateway.context``: a client cannot choose a response id.)
- ``POST /v1/messages/count_tokens``: checked like a Messages body (Anthropic's error
  shape; a model no replica serves: 404), then sent to the least-loaded routable replica
  serving its model (the next one when a connection fails). Nothing is recorded in the
  prefix index: nothing is cached.
- ``GET /v1/models/{id}``: the model card the replicas reported (or an alias's,
  ``gateway.models``), else 404 ``model_not_found``.
- ``GET /model_info`` and ``GET /server_info`` (and SGLang's deprecated ``/get_model_info``,
  ``/get_server_info``): benchmark tools (aiperf, guidellm, inference-perf, SGLang's
  ``bench_serving``) and SGLang's own clients read the tokenizer and model paths there,
  so the gateway relays one routable replica's own answer (least loaded first, the next
  one when a connection fails; each call bounded by ``INFO_TIMEOUT_S``). Headers as for
  every relayed call (``upstream_headers``: the client's credentials only when
  ``upstream.forward_authorization`` says so, ``upstream.replica_api_key`` otherwise).
  Nothing routable: 503 ``no_replica_available`` with ``Retry-After``; the replica
  failing (no answer, or a 5xx): 502.
- ``GET|POST /flush_cache``: an admin action (the admin bearer token,
  ``gateway.admin.require_admin``; counted in ``kvgate_admin_requests``), fanned out
  concurrently to every registered replica (``timeout`` query forwarded as SGLang takes
  it; each call bounded by ``FLUSH_TIMEOUT_S`` plus that timeout). The client's
  Authorization (the gateway's admin token) never reaches a replica: only
  ``upstream.replica_api_key`` does. Each replica that flushed is also forgotten by the
  gateway's prefix index (``PrefixIndex.remove_replica``, which drops its sessions too,
  then its LRU re-sized), so routing stops predicting hits that are gone. 200 with a
  per-replica summary when all flushed; 502 with the same body listing the failures
  (SGLang answers 400 while it is not idle) otherwise; 503 when no replica is registered.
  It lives on the main port even when ``admin.port`` is set (``EdgeApp`` serves only
  ``/admin/*`` there): ``bench_serving --flush-cache`` posts to the URL it benchmarks.
- the app's error handlers (unknown route, wrong method, bugs): Anthropic's shape under
  ``/v1/messages``, OpenAI's elsewhere.
"""
from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Protocol

import httpx
import orjson
from fastapi import APIRouter, Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from gateway.admin import CountedRoute, require_admin
from gateway.api_agents import previous_response_id
from gateway.bodies import read_body
from gateway.context import build_context
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NoReplicaAvailable,
    NotFound,
    UpstreamError,
    endpoint_of,
)
from gateway.models import forwarded_body, model_list, require_served
from gateway.proxy import PINNED
from gateway.relay import (
    HeaderPolicy,
    RelayResponse,
    downstream_headers,
    error_response,
    json_response,
    route_headers,
    upstream_headers,
)
from gateway.responses_store import (
    MemoryResponsesStore,
    RedisResponsesStore,
    ResponsesStoreConfig,
    Tenants,
    owned_by,
)
from policies.base import RequestContext
from policies.routing import serving
from prefix_index.base import PrefixIndex, ReplicaCapacity, ReplicaId
from replicas.model import ReplicaState, ReplicaView
from replicas.registry import Registry

if TYPE_CHECKING:
    from gateway.metrics import GatewayMetrics
    from gateway.settings import Settings

log = logging.getLogger("kvgate.api")
INFO_TIMEOUT_S = 5.0  # /model_info, /server_info: a replica answers them from memory
FLUSH_TIMEOUT_S = 10.0  # /flush_cache per replica, beyond the client's own ``timeout``
MAX_FLUSH_WAIT_S = 300.0  # the largest ``timeout`` a flush may ask the replicas to wait
INFO_PATHS = {"/model_info": "/model_info", "/get_model_info": "/model_info",
              "/server_info": "/server_info", "/get_server_info": "/server_info"}


class AgentGateway(Protocol):
    """What these routes need of the app's ``gateway.app.Gateway`` (no import back)."""

    settings: Settings
    registry: Registry
    client: httpx.AsyncClient
    header_policy: HeaderPolicy
    responses: ResponsesApi
    index: PrefixIndex
    metrics: GatewayMetrics

    @property
    def fleet(self) -> Sizer: ...


class Sizer(Protocol):
    """``gateway.router.FleetListener``: a replica's index LRU size from its view."""

    def capacity(self, view: ReplicaView) -> ReplicaCapacity: ...


_CREATED_ID = re.compile(rb'"id"\s*:\s*"(resp_[^"\\]+)"')
SNIFF_LIMIT = 256 * 1024
CONTROL_BODY_LIMIT = 64 * 1024  # GET/DELETE/cancel of a response carry no real body  # a response.created event is found in the stream's first bytes


class PreviousResponseNotFound(NotFound):
    code = "previous_response_not_found"


class PreviousResponseUnavailable(NoReplicaAvailable):
    code = "previous_response_replica_unavailable"


class ResponsesApi:
    """Pins, records and control calls of Responses ids (see the module docstring)."""

    def __init__(self, store: MemoryResponsesStore | RedisResponsesStore, registry: Registry,
                 client: httpx.AsyncClient, header_policy: HeaderPolicy, tenants: Tenants | None = None) -> None:
        """``tenants``: who owns what (default: credentials hashed under the store's key)."""
        self.store = store
        self.registry = registry
        self.client = client
        self.header_policy = header_policy
        self.tenants = tenants if tenants is not None else Tenants(ResponsesStoreConfig(), store)

    async def tenant(self, headers: Mapping[str, str]) -> str:
        """The tenant of a request (its lower-case headers)."""
        return await self.tenants.of(headers)

    async def pin(self, ctx: RequestContext, tenant: str) -> ReplicaId | None:
        """The replica a request must go to, None when it names no previous response."""
        previous = previous_response_id(ctx.payload)
        if previous is None:
            return None
        return await self._holder(previous, "previous_response_id", routable=True, tenant=tenant)

    async def _holder(self, response_id: str, param: str, routable: bool, tenant: str) -> ReplicaId:
        """The replica of a response ``tenant`` owns; another tenant's is an unknown id."""
        entry = await self.store.get(response_id)
        replica = entry.replica if entry is not None and owned_by(entry, tenant) else None
        view = next((v for v in self.registry.views() if v.id == replica), None)
        if replica is None or view is None:
            gone = "" if replica is None else f" (replica {replica}, which created it, has left the fleet)"
            error: GatewayError = PreviousResponseNotFound(f"Response with id '{response_id}' not found{gone}.",
                                                           param=param)
            if param == "response_id":
                error.code = "not_found"
            raise error
        if routable and not view.routable:
            raise PreviousResponseUnavailable(
                f"the replica holding response '{response_id}' ({replica}) is not available "
                f"({view.state.value}); retry later", param=param)
        return replica

    async def record(self, response: Response, tenant: str) -> Response:
        """Remember which replica created the response (buffered body or stream head), and
        for which tenant."""
        replica = _replica_of(response)
        if replica is None or response.status_code != 200:
            return response
        if isinstance(response, RelayResponse):
            response.body_iterator = self._sniff(response.body_iterator, replica, tenant)
            return response
        found = _CREATED_ID.search(bytes(response.body[:SNIFF_LIMIT]))
        if found:
            await self.store.put(found[1].decode(), replica, tenant)
        return response

    async def _sniff(self, chunks: AsyncIterator[bytes], replica: ReplicaId, tenant: str) -> AsyncIterator[bytes]:
        head = b""
        looking = True
        async for chunk in chunks:
            if looking:
                head += chunk
                if found := _CREATED_ID.search(head):
                    await self.store.put(found[1].decode(), replica, tenant)  # before the client can chain on it
                looking = not found and len(head) < SNIFF_LIMIT
                if not looking:
                    head = b""
            yield chunk

    async def control(self, request: Request) -> Response:
        """GET/DELETE ``/v1/responses/{id}``, POST ``.../cancel``: on the id's replica."""
        response_id = request.path_params["response_id"]
        try:
            tenant = await self.tenant(request.headers)
            replica = await self._holder(response_id, "response_id", routable=False, tenant=tenant)
        except GatewayError as exc:
            return error_response(exc, route_headers("none", PINNED), "responses")
        client = request.client.host if request.client is not None else None
        headers = upstream_headers(request.headers.raw, self.header_policy, client, request.url.scheme)
        try:
            body = await read_body(request, CONTROL_BODY_LIMIT)
        except GatewayError as exc:
            return error_response(exc, route_headers("none", PINNED), "responses")
        try:
            answer = await self.client.request(request.method, f"{replica}{request.url.path}",
                                               headers=headers, content=body)
        except httpx.HTTPError as exc:
            return error_response(UpstreamError(f"replica {replica} failed ({type(exc).__name__})"),
                                  route_headers(replica, PINNED), "responses")
        if request.method == "DELETE" and answer.status_code == 200:
            await self.store.delete(response_id)
        return _relayed(answer, replica, PINNED)


def _replica_of(response: Response) -> ReplicaId | None:
    for name, value in response.raw_headers:
        if name == b"x-kvgate-replica":
            return ReplicaId(value.decode("latin-1"))
    return None


def _relayed(answer: httpx.Response, replica: str, reason: str) -> Response:
    out = Response(answer.content, status_code=answer.status_code)
    out.raw_headers = [*downstream_headers(answer.headers.raw),
                       (b"content-length", b"%d" % len(answer.content)),
                       (b"x-kvgate-replica", replica.encode("latin-1")),
                       (b"x-kvgate-route-reason", reason.encode("latin-1"))]
    return out


async def count_tokens(gateway: AgentGateway, request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: checked, then answered by a routable replica."""
    try:
        body = await read_body(request, gateway.settings.hashing.max_body_bytes)
        ctx = build_context("count_tokens", body, request.headers, request.headers.get("content-type"),
                            gateway.settings)
        require_served(ctx.model, gateway.registry.served_models())
    except GatewayError as exc:
        return error_response(exc, route_headers("none", "rejected"), "count_tokens")
    body = forwarded_body(ctx, body, gateway.settings.models.aliases)
    views = sorted((v for v in serving(gateway.registry.views(), ctx.model) if v.routable),
                   key=lambda v: v.in_flight)
    client = request.client.host if request.client is not None else None
    headers = upstream_headers(request.headers.raw, gateway.header_policy, client, request.url.scheme)
    for view in views:
        try:
            answer = await gateway.client.post(f"{view.id}/v1/messages/count_tokens", headers=headers,
                                               content=body)
        except httpx.ConnectError:
            continue
        except httpx.HTTPError as exc:
            return error_response(UpstreamError(f"replica {view.id} failed ({type(exc).__name__})"),
                                  route_headers(view.id, "count-tokens"), "count_tokens")
        return _relayed(answer, view.id, "count-tokens")
    return error_response(NoReplicaAvailable("no replica can count tokens"), route_headers("none", "no-replica"),
                          "count_tokens")


def model_card(gateway: AgentGateway, request: Request) -> Response:
    """``GET /v1/models/{id}``: the card of a model some replica serves, or of an alias."""
    name = request.path_params["model"]
    cards = model_list(gateway.registry.models(), gateway.settings.models.aliases)
    card = next((c for c in cards if c.get("id") == name), None)
    if card is None:
        return error_response(ModelNotFound(name), route_headers("none", "none"))
    return Response(orjson.dumps(card), media_type="application/json")


async def server_details(gateway: AgentGateway, request: Request) -> Response:
    """``GET /model_info``, ``/server_info`` (and their ``/get_`` aliases): one routable
    replica's own answer (see the module docstring)."""
    path = INFO_PATHS[request.url.path]
    views = sorted((v for v in gateway.registry.views() if v.routable), key=lambda v: v.in_flight)
    client = request.client.host if request.client is not None else None
    headers = upstream_headers(request.headers.raw, gateway.header_policy, client, request.url.scheme)
    for view in views:
        try:
            answer = await gateway.client.get(f"{view.id}{path}", headers=headers, timeout=INFO_TIMEOUT_S)
        except httpx.ConnectError:
            continue
        except httpx.HTTPError as exc:
            return _info_failed(view.id, type(exc).__name__)
        if answer.status_code >= 500:
            return _info_failed(view.id, f"status {answer.status_code}")
        return _relayed(answer, view.id, "server-info")
    if views:
        return _info_failed(views[-1].id, "connection refused by every routable replica")
    return error_response(NoReplicaAvailable(f"no replica is available to answer {path}; retry shortly"),
                          route_headers("none", "no-replica"))


def _info_failed(replica: str, why: str) -> Response:
    return error_response(UpstreamError(f"replica {replica} failed ({why})"), route_headers(replica, "server-info"))


async def flush_cache(gateway: AgentGateway, request: Request) -> Response:
    """``GET|POST /flush_cache``: every replica's flush, concurrently. An admin route
    (``install_sglang_routes``: the admin token checked and the call counted as every
    ``/admin/*`` call is)."""
    wait_s = _flush_wait(request.query_params.get("timeout"))
    views = [v for v in gateway.registry.views() if v.state is not ReplicaState.REMOVED]
    if not views:
        raise NoReplicaAvailable("no replica is registered: nothing to flush")
    policy = gateway.header_policy
    headers = {} if policy.replica_authorization is None else {"authorization": policy.replica_authorization.decode()}
    params = {} if wait_s is None else {"timeout": str(wait_s)}
    bound_s = FLUSH_TIMEOUT_S + (wait_s or 0.0)
    results = await asyncio.gather(*(_flush_one(gateway, v, headers, params, bound_s) for v in views))
    failed = [r for r in results if not r["flushed"]]
    body = {"object": "flush_cache", "flushed": len(results) - len(failed), "failed": len(failed),
            "replicas": results}
    return json_response(body, 502 if failed else 200, route_headers("none", "flush-cache"))


def _flush_wait(raw: str | None) -> float | None:
    """The ``timeout`` query (seconds a replica may wait to be idle), checked as SGLang does."""
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_FLUSH_WAIT_S:
        raise InvalidRequest(f"timeout must be a number of seconds in [0, {MAX_FLUSH_WAIT_S:g}]", param="timeout")
    return value


async def _flush_one(gateway: AgentGateway, view: ReplicaView, headers: dict[str, str],
                     params: dict[str, str], bound_s: float) -> dict[str, object]:
    """One replica's flush, and then its blocks in the gateway's index when it flushed."""
    out: dict[str, object] = {"url": view.id, "flushed": False, "status": None, "index_cleared": False}
    try:
        answer = await gateway.client.post(f"{view.id}/flush_cache", headers=headers, params=params,
                                           timeout=bound_s)
    except httpx.HTTPError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:500]
        return out
    out["status"] = answer.status_code
    out["message"] = answer.text[:500]
    out["flushed"] = answer.status_code == 200
    if out["flushed"]:
        out["index_cleared"] = await _forget_blocks(gateway, view)
    return out


async def _forget_blocks(gateway: AgentGateway, view: ReplicaView) -> bool:
    """The replica's blocks (and sessions) gone from the index, its LRU sized as before."""
    try:
        await gateway.index.remove_replica(view.id)
        if view.device_tokens > 0:
            await gateway.index.set_capacity(view.id, gateway.fleet.capacity(view))
    except Exception as exc:  # noqa: BLE001 - the replica flushed; the index's failure is reported
        log.warning("index: forgetting %s after its flush failed: %s: %s", view.id, type(exc).__name__, exc)
        return False
    return True


def install_agent_routes(app: FastAPI, gw: Callable[[Request], AgentGateway]) -> None:
    """The routes above (the inference ones are ``gateway.app``'s)."""
    async def control(request: Request) -> Response:
        return await gw(request).responses.control(request)

    async def tokens(request: Request) -> Response:
        return await count_tokens(gw(request), request)

    async def model(request: Request) -> Response:
        return model_card(gw(request), request)

    app.add_route("/v1/messages/count_tokens", tokens, methods=["POST"], include_in_schema=False)
    app.add_route("/v1/responses/{response_id}", control, methods=["GET", "DELETE"], include_in_schema=False)
    app.add_route("/v1/responses/{response_id}/cancel", control, methods=["POST"],
                  include_in_schema=False)
    app.add_route("/v1/models/{model:path}", model, methods=["GET"], include_in_schema=False)


def install_sglang_routes(app: FastAPI, gw: Callable[[Request], AgentGateway]) -> None:
    """SGLang's own routes the benchmark tools call: info relayed, the flush fanned out."""
    async def details(request: Request) -> Response:
        return await server_details(gw(request), request)

    async def flush(request: Request) -> Response:
        return await flush_cache(gw(request), request)

    for path in INFO_PATHS:
        app.add_route(path, details, methods=["GET"], include_in_schema=False)
    admin_action = APIRouter(dependencies=[Depends(require_admin)], route_class=CountedRoute)
    admin_action.add_api_route("/flush_cache", flush, methods=["GET", "POST"], include_in_schema=False)
    app.include_router(admin_action)


def install_error_handlers(app: FastAPI) -> None:
    """Errors outside the inference path (unknown route, wrong method, bugs), in the
    shape of the API the path belongs to."""
    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> Response:
        return error_response(exc, api=endpoint_of(request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        error: GatewayError = NotFound(f"no route {request.method} {request.url.path}")
        if exc.status_code != 404:
            error = GatewayError(str(exc.detail))
            error.status = exc.status_code
            error.type = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return error_response(error, api=endpoint_of(request.url.path))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        # reached only through Starlette's ServerErrorMiddleware, which logs the traceback
        error = GatewayError(f"internal gateway error ({type(exc).__name__})")
        return error_response(error, api=endpoint_of(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return error_response(InvalidRequest(f"invalid request: {first.get('msg', exc)}", param=param),
                              api=endpoint_of(request.url.path))
