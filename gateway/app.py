"""The FastAPI application: wiring (lifespan), the OpenAI endpoints, health, metrics.

``create_app(settings)`` builds an app whose lifespan owns every long-lived object,
kept on ``app.state.gateway`` (a ``Gateway``), never in module globals:

- the request path's upstream client (``gateway.upstream.AiohttpUpstream``, a bounded
  pool; it carries no default headers of its own, so the replica sees the client's
  headers, cleaned by ``relay.upstream_headers``), and one
  shared ``httpx.AsyncClient`` for probes (unit tests inject a transport into it, and
  the request path then goes through it too),
- the prefix index (``prefix_index.factory.make_index``),
- the replica registry (probes, load accounting, drain), started and stopped here,
- the policy (``policies.registry.make_policy``) and the ``Router`` around it,
- discovery (``registry.discovery`` dns or kubernetes; static lists are the registry's
  own) and the scale loop (``gateway.scaling.ScaleLoop``: desired replicas, cache-value
  ranking, removal candidates, pod-deletion-cost), both background tasks,
- registry listeners: a replica joining sizes its LRU in the index (tokens -> blocks,
  ``block_tokens = hashing.block_chars / hashing.chars_per_token``) and tells the
  policy; a replica leaving is forgotten by the index and the policy.

Inference endpoints read the body once (bounded by ``max_body_bytes``), build the
``RequestContext`` (``gateway.context.build_context``: the only parse of the body) and
hand both to ``gateway.proxy.Proxy``. While the request waits for its first byte (or
a buffered body), a watcher listens for the client leaving: the handler is then
cancelled, the upstream request closed (SGLang aborts it), and the request counted as
status 499, logged at INFO at most; a client that leaves during the upload is a 499 too.
Errors are in the shape of the request's API (``gateway.errors``: Anthropic's for
``/v1/messages``, OpenAI's otherwise); a model no replica serves is a 404 before
routing, and ``GET /v1/models`` lists the replicas' cards and the aliases
(``gateway.models``). ``/v1/messages`` and ``/v1/responses`` are inference endpoints
like chat; the Responses id pin and record, count_tokens,
``/v1/models/{id}``, SGLang's ``/model_info`` / ``/server_info`` (relayed from a
routable replica) and ``/flush_cache`` (admin, fanned out) are ``gateway.api_routes``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import orjson
from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from gateway import admin
from gateway.admission import Admission
from gateway.api_routes import (
    ResponsesApi,
    install_agent_routes,
    install_error_handlers,
    install_sglang_routes,
)
from gateway.bodies import header_map, read_body
from gateway.client_watch import ClientWatch
from gateway.context import build_context
from gateway.errors import GatewayError
from gateway.kv_wiring import attach_precise
from gateway.metrics import CONTENT_TYPE, OTHER_MODEL, GatewayMetrics
from gateway.models import forwarded_body, model_list, require_served
from gateway.openapi import openapi_document
from gateway.proxy import CLIENT_CLOSED, PINNED, Proxy
from gateway.relay import (
    ClosingResponse,
    HeaderPolicy,
    error_response,
    json_response,
    route_headers,
    upstream_headers,
)
from gateway.responses_store import Tenants, make_responses_store
from gateway.router import LOCAL_SESSIONS, FleetListener, Router
from gateway.scaling import ScaleLoop, make_annotator
from gateway.settings import Settings
from gateway.upstream import AiohttpUpstream, replica_ssl
from policies.base import RequestContext
from policies.framework import Pipeline
from policies.registry import make_policy
from prefix_index.base import PrefixIndex
from prefix_index.factory import make_index
from replicas.discovery import make_discovery
from replicas.probe import AiohttpGetter
from replicas.registry import Registry
from replicas.shared_state import SharedState
from replicas.speed import fleet_seed

log = logging.getLogger("kvgate.app")

ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "generate": "/generate",
                  "messages": "/v1/messages", "responses": "/v1/responses"}


def make_client(settings: Settings) -> httpx.AsyncClient:
    """The control plane's client (server info, models, KV-event discovery, Responses
    relays, scale annotations): explicit timeouts, pool limits, no default headers."""
    timeout = httpx.Timeout(connect=settings.upstream.connect_timeout_s, read=settings.upstream.read_timeout_s,
                            write=settings.upstream.read_timeout_s, pool=settings.upstream.first_byte_timeout_s)
    limits = httpx.Limits(max_connections=settings.upstream.max_connections,
                          max_keepalive_connections=settings.upstream.max_connections, keepalive_expiry=30.0)
    client = httpx.AsyncClient(timeout=timeout, limits=limits, http1=True, http2=False,
                               follow_redirects=False, trust_env=False, verify=replica_ssl(settings.upstream))
    for name in ("accept", "accept-encoding", "user-agent", "connection"):
        client.headers.pop(name, None)
    return client


class Gateway:
    """Everything a request needs, built by the lifespan and kept on ``app.state``."""

    def __init__(self, settings: Settings, client: httpx.AsyncClient, index: PrefixIndex,
                 registry: Registry, policy: Pipeline, *, shared_state: bool = False) -> None:
        self.settings = settings
        self.client = client
        self.index = index
        self.registry = registry
        self.policy = policy
        self.shared_state = shared_state  # several gateways share replica state (reserve())
        self.metrics = GatewayMetrics()
        self.metrics.served_models = registry.served_models  # the model label's values
        # one clock for routing: wall time, so session times stored in a shared Redis
        # compare across hosts and with the registry's added_at_s (also wall time)
        self.router = Router(policy, index, registry.views, self.metrics, clock=time.time, ids=registry.ids,
                             rng=policy.new_rng(),
                             local_sessions=min(settings.index.max_sessions, LOCAL_SESSIONS))
        self.scaling = ScaleLoop(settings.scale, registry, registry.views, index, policy.resident_window_s,
                                 self.metrics, make_annotator(settings.scale))
        self.hits = self.scaling.hits  # the proxy records each request's cached tokens here
        # prefill admission: streaming requests held per replica, released shortest prefill first
        self.admission = Admission(settings.admission, on_waited=self.metrics.admission_waited)
        registry.held_prefill = self.admission.held
        registry.add_listener(self.admission)
        self.proxy = Proxy(settings.upstream, AiohttpUpstream(settings.upstream), self.router, registry,
                           self.metrics, self.hits, shared_state=shared_state, admission=self.admission)
        self.header_policy = HeaderPolicy.from_config(settings.upstream)
        index_cfg = settings.index
        store = make_responses_store(settings.responses, index_cfg.redis_url, index_cfg.key_prefix)
        self.responses = ResponsesApi(store, registry, client, self.header_policy, Tenants(settings.responses, store))
        hashing = settings.hashing
        self.fleet = FleetListener(index, policy, hashing.block_chars / hashing.chars_per_token)
        registry.add_listener(self.fleet)
        # precise mode: KV-event subscribers for the replicas that publish them (None: off)
        self.precise = attach_precise(settings.index, client, registry, self.router, self.metrics)
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await self.registry.start()
        if self.settings.registry.discovery != "static":
            discovery = make_discovery(self.settings.registry, self.registry)
            self._tasks.append(asyncio.create_task(discovery.run(), name="discovery"))
        self._tasks.append(asyncio.create_task(self.scaling.run(), name="scale"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.scaling.close()
        await self.registry.stop()
        if self.precise is not None:
            await self.precise.close()
        await self.fleet.close()
        await self.index.close()
        await self.proxy.close()
        await self.responses.store.close()
        await self.client.aclose()

    def request_done(self, endpoint: str, status: int, started_s: float, model: str = OTHER_MODEL) -> None:
        self.metrics.request_done(endpoint, status, time.perf_counter() - started_s, model)

    async def handle(self, request: Request, endpoint: str) -> Response:
        """One inference request: read, parse once, route and relay."""
        started_s = time.perf_counter()
        try:
            raw_headers: list[tuple[bytes, bytes]] = request.scope["headers"]
            headers = header_map(raw_headers)
            body = await read_body(request, self.settings.hashing.max_body_bytes, headers)
            ctx = build_context(endpoint, body, headers, headers.get("content-type"), self.settings)
            require_served(ctx.model, self.registry.served_models())
        except GatewayError as exc:
            return self._answered(endpoint, error_response(exc, route_headers("none", "rejected"), endpoint),
                                  started_s)
        except ClientDisconnect:
            log.info("client left during the upload of a %s request", endpoint)
            return self._answered(endpoint, Response(status_code=CLIENT_CLOSED), started_s)
        try:  # a Responses request: its tenant owns what it creates and may continue only its own
            tenant = await self.responses.tenant(headers) if endpoint == "responses" else ""
            pin = await self.responses.pin(ctx, tenant) if endpoint == "responses" else None
        except GatewayError as exc:
            return self._answered(endpoint, error_response(exc, route_headers("none", PINNED), endpoint), started_s)
        scope = request.scope
        # the scope's client and scheme, not request.client / request.url: objects built each time they are read
        peer = scope.get("client")
        out_headers = upstream_headers(raw_headers, self.header_policy, peer[0] if peer else None,
                                       scope.get("scheme", "http"))
        response = await self._until_client_leaves(
            request, self.proxy.forward(ctx, ENDPOINT_PATHS[endpoint],
                                        forwarded_body(ctx, body, self.settings.models.aliases), out_headers,
                                        started_s, pin))
        if isinstance(response, ClosingResponse) and endpoint == "responses":
            relayed = response
            try:
                response = await self.responses.record(relayed, tenant)
            except BaseException:  # it will not be sent: its lease and feedback all the same
                await relayed.abandon()
                raise
        return self._finished(ctx, response, started_s)

    def _finished(self, ctx: RequestContext, response: Response | None, started_s: float) -> Response:
        """The client's response (499 when it left first), counted unless it counts itself."""
        if response is None:
            log.info("client left before the answer of request %s", ctx.request_id)
            response = Response(status_code=CLIENT_CLOSED)
        if not isinstance(response, ClosingResponse):  # a relayed answer counts itself once sent
            self.request_done(ctx.endpoint, response.status_code, started_s, ctx.model)
        return response

    def _answered(self, endpoint: str, response: Response, started_s: float) -> Response:
        self.request_done(endpoint, response.status_code, started_s)
        return response

    @staticmethod
    async def _until_client_leaves(request: Request, forward: Awaitable[Response]) -> Response | None:
        """``forward``'s response, or None when the client left first (``forward`` is then
        cancelled: the upstream request is closed and its lease released)."""
        async with ClientWatch(request.receive):
            return await forward
        return None  # the client left (its cancellation was swallowed)

    async def refresh_metrics(self) -> None:
        """Fleet gauges and cumulative totals kept by the registry, index and policy."""
        try:
            stats = await self.index.stats()
        except Exception as exc:  # noqa: BLE001 - a scrape must work with the index down
            log.warning("index stats failed: %s: %s", type(exc).__name__, exc)
            stats = None
        self.metrics.refresh_fleet(self.registry.views(), stats)
        self.metrics.plugin_time({k: t.total_s for k, t in self.policy.timings().items()})
        self.metrics.index_degraded_backend(int(getattr(self.index, "degraded_total", 0)))
        self.metrics.ejections(self.registry.ejections_total, (v.id for v in self.registry.views()))


def build_gateway(settings: Settings) -> Gateway:
    client = make_client(settings)
    index = make_index(settings.index)
    policy = make_policy(settings.policy.name, settings.policy.params, settings.policy.seed)
    shared_cfg = settings.registry.shared
    shared = SharedState.from_url(shared_cfg) if shared_cfg.redis_url else None
    probes = AiohttpGetter(ssl=replica_ssl(settings.upstream))  # a pool of its own
    registry = Registry(settings.registry, client, shared=shared, clock=time.time, probes=probes,
                        speed_seed=fleet_seed(settings.policy.params))
    return Gateway(settings, client, index, registry, policy, shared_state=shared is not None)


def _install_routes(app: FastAPI) -> None:
    def gw(request: Request) -> Gateway:
        gateway: Gateway = request.app.state.gateway
        return gateway

    def inference(endpoint: str) -> Callable[[Request], Awaitable[Response]]:
        async def handler(request: Request) -> Response:
            return await gw(request).handle(request, endpoint)

        return handler

    # plain Starlette routes: the hot path skips FastAPI's dependency machinery
    for endpoint, path in ENDPOINT_PATHS.items():
        app.add_route(path, inference(endpoint), methods=["POST"], include_in_schema=False)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        gateway = gw(request)
        return json_response({"object": "list",
                              "data": model_list(gateway.registry.models(), gateway.settings.models.aliases)})

    install_agent_routes(app, gw)  # count_tokens, /v1/responses/{id}[/cancel], /v1/models/{id}
    install_sglang_routes(app, gw)  # /model_info, /server_info (relayed), /flush_cache (admin, fanned out)

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        routable = sum(1 for v in gw(request).registry.views() if v.routable)
        return json_response({"ready": routable > 0, "routable_replicas": routable}, 200 if routable else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        gateway = gw(request)
        await gateway.refresh_metrics()
        return Response(gateway.metrics.exposition(), media_type=CONTENT_TYPE)

    document = orjson.dumps(openapi_document())

    @app.get("/openapi.json")
    async def openapi() -> Response:
        return Response(document, media_type="application/json")


def create_app(settings: Settings) -> FastAPI:
    """The gateway app."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gateway = build_gateway(settings)
        await gateway.start()
        app.state.gateway = gateway
        log.info("kvgate gateway on %s:%d, policy %s, %d static replica(s)", settings.host, settings.port,
                 settings.policy.name, len(settings.registry.replicas))
        try:
            yield
        finally:
            await gateway.close()

    app = FastAPI(title="kvgate", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    _install_routes(app)
    install_error_handlers(app)
    app.include_router(admin.router)
    return app
