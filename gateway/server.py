"""The gateway's HTTP server: uvicorn with client-side bounds and a graceful shutdown.

uvicorn arms its keep-alive timer only after a response, so a connection that never
finishes a request is never closed, and its ``limit_concurrency`` answers plain text.
This module adds, per process:

- ``EdgeProtocol`` (uvicorn's httptools protocol, subclassed): a connection that sends
  nothing is closed after ``server.idle_timeout_s``; headers not complete within
  ``header_timeout_s`` of their first byte -> 408 and close; a body not complete within
  ``body_timeout_s`` of the headers -> 408, close, and the app sees ``http.disconnect``.
  At ``max_connections`` a new connection evicts the longest-idle one (no request in
  progress; as nginx reuses idle keep-alive connections) and is refused with 503 only
  when none is idle, so ``/ready`` answers with thousands of idle sockets open.
- ``EdgeApp`` (ASGI front): the concurrency cap (503 OpenAI-shaped with ``Retry-After``;
  probes are never refused), the separate admin listener (``admin.port``: only
  ``/admin/*`` there, none of it on the main port), readiness false while shutting down,
  the end of cut requests, and an OpenAI-shaped 500 (and 400 from the parser) where
  uvicorn would answer plain text.
- ``GatewayServer`` (``uvicorn.Server``): on SIGTERM ``/ready`` turns 503 at once while
  the listeners stay open (a load balancer still sending gets answers), responses close
  their connections, requests in flight get ``shutdown_grace_s``; then the listeners
  close and whatever is still running is cut: an open SSE stream gets
  ``data: {"error": {... "type": "server_shutdown"}}`` and ``data: [DONE]``.

Everything is counted in ``GatewayMetrics`` (``client_connections``,
``client_connections_closed{reason}``, ``requests_rejected{reason}``,
``streams_cut_at_shutdown``). The state shared by the three lives in one ``Edge`` per
process: the server creates it and hands it to the app through the ASGI lifespan state
(``EDGE_KEY``), which works the same in one process and in ``--workers`` children.
"""
from __future__ import annotations

import asyncio
import logging
import resource
import time
from asyncio import TimerHandle, current_task
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import Server, ServerState

from gateway.errors import error_body
from gateway.relay import sse_error
from gateway.settings import ServerConfig

if TYPE_CHECKING:
    import socket

    from starlette.types import ASGIApp, Message, Receive, Scope, Send
    from uvicorn.config import Config

    from gateway.metrics import GatewayMetrics
    from gateway.settings import Settings

log = logging.getLogger("kvgate.server")
FD_MARGIN = 64  # files, Redis, listeners, logs beside client and upstream connections
CUT_SEND_TIMEOUT_S = 2.0  # bound on writing the last event to a client that does not read


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


EDGE_KEY = "kvgate_edge"  # key of the Edge in the ASGI lifespan state
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})  # never refused by the concurrency cap


def error_bytes(message: str, type_: str, code: str) -> bytes:
    return orjson.dumps(error_body(message, type_, code))


def raw_response(status: int, body: bytes, *, retry_after: bool = False) -> bytes:
    """A complete ``Connection: close`` JSON response, written by the protocol itself."""
    reason = {400: b"Bad Request", 408: b"Request Timeout", 503: b"Service Unavailable"}.get(status, b"Error")
    extra = b"retry-after: 1\r\n" if retry_after else b""
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s"
            b"connection: close\r\n\r\n%s" % (status, reason, len(body), extra, body))


class Edge:
    """The client edge of one gateway process: connection table, requests, shutdown phase."""

    def __init__(self, config: ServerConfig, max_connections: int) -> None:
        self.config = config
        self.max_connections = max_connections
        self.metrics: GatewayMetrics | None = None  # the app's, bound at lifespan start-up
        self.open = 0
        self.idle: OrderedDict[EdgeProtocol, None] = OrderedDict()  # no request in progress, oldest first
        self.requests: set[asyncio.Task[Any]] = set()  # ASGI request tasks in progress
        self.active = 0  # of which counted by the concurrency cap
        self.admin_port: int | None = None  # bound port of the admin-only listener
        self.draining = False  # SIGTERM: /ready 503, responses close their connection
        self.closing = False  # listeners closed: a request still arriving gets 503
        self.cutting = False  # grace over: requests in progress are being cut

    def evict_idle(self) -> bool:
        """Close the longest-idle connection; False when none is idle."""
        if not self.idle:
            return False
        victim, _ = self.idle.popitem(last=False)
        victim.evict()
        return True

    def metric_gauge(self, delta: int) -> None:
        if self.metrics is not None:
            self.metrics.client_connections.inc(delta)

    def closed(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.client_connections_closed.labels(reason=reason).inc()

    def rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.requests_rejected.labels(reason=reason).inc()


class EdgeServerState(ServerState):
    """uvicorn's per-server state plus the ``Edge`` every protocol instance reads."""

    def __init__(self, edge: Edge) -> None:
        super().__init__()
        self.edge = edge


class EdgeProtocol(HttpToolsProtocol):
    """httptools protocol with idle/header/body deadlines and the connection cap."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        assert isinstance(server_state, EdgeServerState), "EdgeProtocol runs under GatewayServer"
        self.edge = server_state.edge
        self.timeout_keep_alive = self.edge.config.keep_alive_timeout_s  # type: ignore[assignment]  # float
        self.deadline: TimerHandle | None = None
        self.busy = False  # a request is in progress (first byte .. response complete)
        self.counted = False

    # ----------------------------------------------------------------- connections
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        edge = self.edge
        edge.open += 1
        self.counted = True
        edge.metric_gauge(+1)
        if edge.open > edge.max_connections and not edge.evict_idle():
            edge.rejected("connection_cap")
            transport.write(raw_response(503, error_bytes(
                "too many connections to the gateway; retry shortly", "service_unavailable", "connection_cap"),
                retry_after=True))
            self._drop()
            return
        self._arm(self.edge.config.idle_timeout_s, "idle")
        edge.idle[self] = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.edge.idle.pop(self, None)
        self._uncount()
        super().connection_lost(exc)

    def _uncount(self) -> None:
        if self.counted:
            self.counted = False
            self.edge.open -= 1
            self.edge.metric_gauge(-1)

    def _drop(self) -> None:
        """Close now; forget the connection at once (a new one may take its place)."""
        self._disarm()
        self.edge.idle.pop(self, None)
        self._uncount()
        self.transport.close()

    def evict(self) -> None:
        self.edge.closed("evicted")
        self._drop()

    # ----------------------------------------------------------------- deadlines
    def _arm(self, delay_s: float, reason: str) -> None:
        self._disarm()
        self.deadline = self.loop.call_later(delay_s, self._expired, reason)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expired(self, reason: str) -> None:
        self.deadline = None
        if self.transport.is_closing():
            return
        self.edge.closed(reason)
        cycle = self.cycle  # for a header timeout: the previous request's cycle, if any
        if reason != "idle" and (cycle is None or cycle.response_complete or not cycle.response_started):
            what = "request headers" if reason == "header_timeout" else "request body"
            limit = self.edge.config.header_timeout_s if reason == "header_timeout" else self.edge.config.body_timeout_s
            self.transport.write(raw_response(408, error_bytes(
                f"{what} not received within {limit:g} s", "invalid_request_error", "request_timeout")))
        if reason == "body_timeout" and cycle is not None:
            cycle.disconnected = True  # the app's receive() now answers http.disconnect
            cycle.message_event.set()
        self._drop()

    # ----------------------------------------------------------------- parser events
    def data_received(self, data: bytes) -> None:
        if not self.busy:  # the first byte of a request (even a stray CRLF) starts the header clock
            self.busy = True
            self.edge.idle.pop(self, None)
            self._arm(self.edge.config.header_timeout_s, "header_timeout")
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.deadline is None:  # a pipelined request behind the one just parsed
            self._arm(self.edge.config.header_timeout_s, "header_timeout")

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        if not self.transport.is_closing() and not self.pipeline:  # a queued request waits its turn
            self._arm(self.edge.config.body_timeout_s, "body_timeout")

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)
        super().on_response_complete()  # arms uvicorn's keep-alive timer when nothing is queued
        if not pipelined and not self.transport.is_closing():
            self.busy = False
            self.edge.idle[self] = None  # most recently idle last

    def send_400_response(self, msg: str) -> None:
        """A request the parser rejects (ambiguous framing, bad syntax): 400 OpenAI-shaped."""
        self.transport.write(raw_response(400, error_bytes(msg, "invalid_request_error", "invalid_request")))
        self._drop()

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing():
            self.edge.closed("idle")
        self.edge.idle.pop(self, None)
        super().timeout_keep_alive_handler()


class EdgeApp:
    """ASGI front: admin-port split, readiness while shutting down, the concurrency cap,
    and the end of requests cut at shutdown. Passes everything through until a
    ``GatewayServer`` hands it an ``Edge`` (unit tests over ``httpx.ASGITransport`` have none)."""

    def __init__(self, app: ASGIApp, metrics: Callable[[], GatewayMetrics | None]) -> None:
        self.app = app
        self.metrics = metrics
        self.edge: Edge | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.edge is not None:
            await self._http(self.edge, scope, receive, send)
        elif scope["type"] == "lifespan":
            await self.app(scope, receive, self._lifespan_send(scope, send))
        else:
            await self.app(scope, receive, send)

    def _lifespan_send(self, scope: Scope, send: Send) -> Send:
        state = scope.get("state")
        edge = state.get(EDGE_KEY) if isinstance(state, dict) else None

        async def lifespan_send(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete" and isinstance(edge, Edge):
                edge.metrics = self.metrics()
                self.edge = edge
            await send(message)

        return lifespan_send

    def _refusal(self, edge: Edge, scope: Scope) -> tuple[int, bytes, bool] | None:
        """(status, body, retry-after) when the request is answered here, else None."""
        path: str = scope["path"]
        if edge.admin_port is not None:
            on_admin = (scope.get("server") or ("", None))[1] == edge.admin_port
            if on_admin != (path == "/admin" or path.startswith("/admin/")):
                return 404, error_bytes(f"no route {scope['method']} {path}", "invalid_request_error",
                                        "not_found"), False
        if edge.draining and path == "/ready":
            return 503, orjson.dumps({"ready": False, "draining": True, "routable_replicas": 0}), False
        if edge.closing:
            edge.rejected("shutting_down")
            return 503, error_bytes("the gateway is shutting down", "service_unavailable", "server_shutdown"), True
        if path not in PROBE_PATHS and edge.active >= edge.config.max_concurrent_requests:
            edge.rejected("concurrency_cap")
            return 503, error_bytes("too many requests in progress at the gateway; retry shortly",
                                    "service_unavailable", "concurrency_cap"), True
        return None

    async def _http(self, edge: Edge, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self._refusal(edge, scope)
        if refusal is not None:
            status, body, retry_after = refusal
            headers = [(b"content-type", b"application/json")] + ([(b"retry-after", b"1")] if retry_after else [])
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        counted = scope["path"] not in PROBE_PATHS
        task = current_task()
        edge.active += counted
        edge.requests.add(task)  # type: ignore[arg-type]  # always inside a task here
        relay = _Relay(send, edge)
        try:
            await self.app(scope, receive, relay.send)
        except asyncio.CancelledError:
            if not edge.cutting or task is None:
                raise
            task.uncancel()  # the cut was ours: answer instead of dying
            await relay.cut()
        except Exception:  # uvicorn would answer a plain-text 500: ours is OpenAI-shaped
            log.exception("request failed: %s %s", scope["method"], scope["path"])
            if relay.started:
                raise
            await relay.send({"type": "http.response.start", "status": 500,
                              "headers": [(b"content-type", b"application/json")]})
            await relay.send({"type": "http.response.body", "body": error_bytes(
                "internal gateway error", "internal_error", "internal_error")})
        finally:
            edge.active -= counted
            edge.requests.discard(task)


class _Relay:
    """Wraps ``send`` to see what the response is (SSE or not, started, complete)."""

    __slots__ = ("boundary", "done", "edge", "sse", "started", "upstream")

    def __init__(self, upstream: Send, edge: Edge) -> None:
        self.upstream, self.edge = upstream, edge
        self.started = self.sse = self.done = False
        self.boundary = True  # the bytes sent so far end between two SSE events

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            body = message.get("body")
            if body:
                self.boundary = body.endswith(b"\n\n")
            self.done = not message.get("more_body", False)
        elif kind == "http.response.start":
            self.started = True
            headers = message.get("headers") or ()
            for name, value in headers:
                if name.lower() == b"content-type":
                    self.sse = value.startswith(b"text/event-stream")
                    break
            if self.edge.draining:  # the client's next request goes to a new connection
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await self.upstream(message)

    async def cut(self) -> None:
        """The request was cut at the end of the shutdown grace: say so to the client."""
        message = "the gateway shut down before the response was complete; retry"
        try:
            async with asyncio.timeout(CUT_SEND_TIMEOUT_S):
                if not self.started:
                    await self.send({"type": "http.response.start", "status": 503,
                                     "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")]})
                    await self.send({"type": "http.response.body",
                                     "body": error_bytes(message, "server_shutdown", "server_shutdown")})
                elif self.sse and not self.done:
                    body = (b"" if self.boundary else b"\n\n") + shutdown_event(message)
                    await self.send({"type": "http.response.body", "body": body, "more_body": False})
                    if self.edge.metrics is not None:
                        self.edge.metrics.streams_cut_at_shutdown.inc()
        except (TimeoutError, OSError, RuntimeError) as exc:
            log.info("could not end a cut request: %s: %s", type(exc).__name__, exc)


class GatewayServer(Server):
    """uvicorn's server with the edge state, extra listeners and the graceful shutdown."""

    def __init__(self, config: Config, edge: Edge) -> None:
        super().__init__(config)
        self.edge = edge
        self.server_state = EdgeServerState(edge)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.lifespan.state[EDGE_KEY] = self.edge  # the app finds the edge in its lifespan state
        await super().startup(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        edge = self.edge
        grace_s = edge.config.shutdown_grace_s
        edge.draining = True
        log.info("shutting down: not ready; %d request(s) in flight get up to %.0f s", len(edge.requests), grace_s)
        # idle keep-alive connections stay open (closing them races with a client reusing
        # one); responses from now on close theirs (EdgeApp adds "Connection: close")
        deadline = time.monotonic() + grace_s
        while edge.requests and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        edge.closing = True
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        await self._cut(edge)
        if not self.force_exit:
            await self.lifespan.shutdown()

    async def _cut(self, edge: Edge) -> None:
        """End what is still running: streams get their last event (``EdgeApp``)."""
        if edge.requests:
            log.warning("shutdown grace over: cutting %d request(s)", len(edge.requests))
            edge.cutting = True
            for task in list(edge.requests):
                task.cancel()
        deadline = time.monotonic() + CUT_SEND_TIMEOUT_S + 1.0
        while (edge.requests or self.server_state.tasks) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for task in self.server_state.tasks:
            task.cancel()
        while self.server_state.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.02)


def shutdown_event(message: str) -> bytes:
    """The SSE event that ends a stream cut at shutdown, then ``[DONE]``."""
    return sse_error(message, "server_shutdown", "server_shutdown")
