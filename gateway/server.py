"""The gateway's HTTP server: Granian (embedded) with the client edge's bounds and a
graceful shutdown, on public APIs only.

Why Granian (docs/design.md, "The HTTP server"): its HTTP/1.1 stack (hyper) closes a
connection that has not delivered a request's headers within ``server.header_timeout_s``
of its start or of the previous response: a silent new connection, headers trickled
byte by byte and an idle keep-alive connection alike. uvicorn's public settings cannot
bound the first two, so a few hundred silent connections there hold every slot forever.

- ``Edge``: the state of one process's client edge (requests in progress, the shutdown
  phase) that the ASGI front and the runner share.
- ``EdgeApp`` (ASGI front): the concurrency cap (503 in the API's shape with
  ``Retry-After``; probes are never refused), the request body deadline (408 and the
  connection closed), the separate admin listener (``admin.port``: ``/admin/*`` and the
  probes ``/health``, ``/ready``, ``/metrics`` there, no ``/admin/*`` on the main port),
  readiness false while shutting down, the end of cut requests, and a 500 in the API's
  shape where the server would answer plain text.
- ``serve``: runs the app's lifespan, one embedded Granian server per listener in this
  event loop, and the shutdown. On SIGTERM ``/ready`` turns 503 at once while the
  listeners stay open (a load balancer still sending gets answers), responses close their
  connections, requests in flight get ``shutdown_grace_s``; then whatever is still
  running is cut (an open SSE stream gets ``data: {"error": {... "type":
  "server_shutdown"}}`` and ``data: [DONE]``), the listeners close and the lifespan ends.

At ``server.max_connections`` open connections Granian stops accepting (``backpressure``
is a per-listener bound on accepted connections, whatever they do): a new client waits in
the listen backlog until a connection ends, at the latest when an idle or trickling one
reaches its header deadline; it is never refused for idle connections. Which connections
hold the slots, Granian does not let us choose: its accept loop and HTTP/1.1 parser are in
Rust and a connection reaches the app only once a request's headers are complete, so
there is no public way to close unfinished connections first or to cap them per peer
address (docs/safety.md, "Slow-header clients"). Each listener has its own slots and
backlog, so the probes on the admin listener are never starved by client traffic.
Counted in ``GatewayMetrics``: ``requests_rejected{reason}``, ``streams_cut_at_shutdown``.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from asyncio import current_task
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import orjson
from granian.constants import HTTPModes, Interfaces
from granian.http import HTTP1Settings
from granian.server.embed import Server

from gateway.errors import anthropic_error_body, api_of, endpoint_of, error_body
from gateway.relay import SSE_MEDIA, sse_error
from gateway.settings import ServerConfig

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from gateway.metrics import GatewayMetrics

log = logging.getLogger("kvgate.server")
CUT_SEND_TIMEOUT_S = 2.0  # bound on writing the last event to a client that does not read
STOP_TIMEOUT_S = 5.0  # bound on the listeners' own stop once nothing is in flight
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})  # never refused by the concurrency cap
LISTEN_BACKLOG = 1024  # connections waiting to be accepted (Granian's embedded default: 128)


class Edge:
    """The client edge of one gateway process: requests in progress, the shutdown phase."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics: GatewayMetrics | None = None  # the app's, bound once its lifespan started
        self.requests: set[asyncio.Task[Any]] = set()  # ASGI request tasks in progress
        self.active = 0  # of which counted by the concurrency cap
        self.admin_port: int | None = None  # bound port of the admin listener (admin API, probes)
        self.draining = False  # SIGTERM: /ready 503, responses close their connection
        self.closing = False  # grace over: a request still arriving gets 503
        self.cutting = False  # grace over: requests in progress are being cut

    def in_flight(self) -> int:
        return len(self.requests)

    def rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.requests_rejected.labels(reason=reason).inc()


class EdgeApp:
    """ASGI front: admin-port split, readiness while shutting down, the concurrency cap,
    the body deadline, and the end of requests cut at shutdown."""

    def __init__(self, app: ASGIApp, edge: Edge) -> None:
        self.app = app
        self.edge = edge

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        edge = self.edge
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
        relay = _Relay(send, edge, scope["path"])
        deadline = _BodyDeadline(receive, relay, edge)
        try:
            await self.app(scope, deadline.receive, relay.send)
        except asyncio.CancelledError:
            if not edge.cutting or task is None:
                raise
            task.uncancel()  # the cut was ours: answer instead of dying
            await relay.cut()
        except Exception:  # the server would answer a plain-text 500: ours is in the API's shape
            log.exception("request failed: %s %s", scope["method"], scope["path"])
            if relay.started:
                raise
            await relay.answer(500, edge_error(scope["path"], 500, "internal gateway error", "internal_error",
                                                "internal_error"))
        finally:
            edge.active -= counted
            edge.requests.discard(task)

    def _refusal(self, edge: Edge, scope: Scope) -> tuple[int, bytes, bool] | None:
        """(status, body, retry-after) when the request is answered here, else None."""
        path: str = scope["path"]
        if edge.admin_port is not None:
            port = (scope.get("server") or ("", None))[1]
            on_admin = port is not None and int(port) == edge.admin_port  # (Granian: a str, ASGI: an int)
            admin_path = path == "/admin" or path.startswith("/admin/")
            if admin_path != on_admin and not (on_admin and path in PROBE_PATHS):
                return 404, edge_error(path, 404, f"no route {scope['method']} {path}", "invalid_request_error",
                                        "not_found"), False
        if edge.draining and path == "/ready":
            return 503, orjson.dumps({"ready": False, "draining": True, "routable_replicas": 0}), False
        if edge.closing:
            edge.rejected("shutting_down")
            return 503, edge_error(path, 503, "the gateway is shutting down", "service_unavailable",
                                    "server_shutdown"), True
        if path not in PROBE_PATHS and edge.active >= edge.config.max_concurrent_requests:
            edge.rejected("concurrency_cap")
            return 503, edge_error(path, 503, "too many requests in progress at the gateway; retry shortly",
                                    "service_unavailable", "concurrency_cap"), True
        return None


class _BodyDeadline:
    """``receive`` with the body deadline: the whole body within ``body_timeout_s`` of the
    request's start, else a 408 (``Connection: close``) and, for the app, a disconnect."""

    __slots__ = ("_deadline", "_done", "_edge", "_receive", "_relay")

    def __init__(self, receive: Receive, relay: _Relay, edge: Edge) -> None:
        self._receive, self._relay, self._edge = receive, relay, edge
        self._deadline = asyncio.get_running_loop().time() + edge.config.body_timeout_s
        self._done = False

    async def receive(self) -> Message:
        if self._done:  # the body is read: only the disconnect can come, whenever it does
            return await self._receive()
        try:
            async with asyncio.timeout_at(self._deadline):
                message = await self._receive()
        except TimeoutError:
            self._done = True
            self._edge.rejected("body_timeout")
            await self._relay.answer(408, edge_error(self._relay.path, 408, "the request body did not arrive in "
                                                     "time", "invalid_request_error", "request_timeout"),
                                     close=True)
            self._relay.finished = True  # what the app sends after this is dropped
            return {"type": "http.disconnect"}
        if message["type"] != "http.request" or not message.get("more_body", False):
            self._done = True
        return message


class _Relay:
    """Wraps ``send`` to see what the response is (SSE or not, started, complete)."""

    __slots__ = ("boundary", "done", "edge", "finished", "path", "sse", "started", "upstream")

    def __init__(self, upstream: Send, edge: Edge, path: str) -> None:
        self.upstream, self.edge, self.path = upstream, edge, path
        self.started = self.sse = self.done = self.finished = False
        self.boundary = True  # the bytes sent so far end between two SSE events

    async def send(self, message: Message) -> None:
        if self.finished:
            return
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
                    self.sse = value.startswith(SSE_MEDIA)
                    break
            if self.edge.draining:  # the client's next request goes to a new connection
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await self.upstream(message)

    async def answer(self, status: int, body: bytes, *, retry_after: bool = False, close: bool = False) -> None:
        """A whole JSON answer of the edge's own (only before the response started)."""
        headers = [(b"content-type", b"application/json")]
        if retry_after:
            headers.append((b"retry-after", b"1"))
        if close:
            headers.append((b"connection", b"close"))
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})

    async def cut(self) -> None:
        """The request was cut at the end of the shutdown grace: say so to the client."""
        message = "the gateway shut down before the response was complete; retry"
        try:
            async with asyncio.timeout(CUT_SEND_TIMEOUT_S):
                if not self.started:
                    await self.answer(503, edge_error(self.path, 503, message, "server_shutdown", "server_shutdown"),
                                      retry_after=True)
                elif self.sse and not self.done:
                    body = (b"" if self.boundary else b"\n\n") + shutdown_event(message, endpoint_of(self.path))
                    await self.send({"type": "http.response.body", "body": body, "more_body": False})
                    if self.edge.metrics is not None:
                        self.edge.metrics.streams_cut_at_shutdown.inc()
        except (TimeoutError, OSError, RuntimeError) as exc:
            log.info("could not end a cut request: %s: %s", type(exc).__name__, exc)


def listener(app: ASGIApp, host: str, port: int, config: ServerConfig) -> Server:
    """One embedded Granian server on ``host:port`` (HTTP/1.1 only: its header deadline
    holds for HTTP/1.1, and replicas and agents speak it). The app's lifespan is run by
    ``serve``, once for all listeners."""
    return Server(app, address=host, port=port, interface=Interfaces.ASGINL, http=HTTPModes.http1,
                  websockets=False, backlog=LISTEN_BACKLOG, backpressure=config.max_connections,
                  http1_settings=HTTP1Settings(header_read_timeout=int(config.header_timeout_s * 1000),
                                               keep_alive=True),
                  log_enabled=False)


async def serve(app: EdgeApp, lifespan: Callable[[], contextlib.AbstractAsyncContextManager[GatewayMetrics]],
                listeners: list[tuple[str, int]]) -> None:
    """Run ``app`` on ``listeners`` (host, port) until SIGTERM or SIGINT, then shut down
    gracefully (the module docstring); ``lifespan`` starts the app and yields its metrics."""
    edge = app.edge
    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (force if stop.is_set() else stop).set()  # a second signal ends the grace at once

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        async with lifespan() as metrics:
            edge.metrics = metrics
            servers = [listener(app, host, port, edge.config) for host, port in listeners]
            running = [asyncio.create_task(s.serve(), name=f"listener {host}:{port}")
                       for s, (host, port) in zip(servers, listeners, strict=True)]
            async with _first_of(stop.wait(), *running):
                pass
            await _drain(edge, force)
            for server in servers:
                server.stop()  # type: ignore[no-untyped-call]  # (granian's signature is untyped)
            _, pending = await asyncio.wait(running, timeout=STOP_TIMEOUT_S)
            for task in pending:
                task.cancel()
            for task in running:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise RuntimeError(f"{task.get_name()} failed") from task.exception()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


@contextlib.asynccontextmanager
async def _first_of(*waits: Any) -> AsyncIterator[None]:
    """Waits until the first of ``waits`` (awaitables or tasks) is done; cancels only the
    awaitables it wrapped, never the tasks it was given."""
    tasks = [w if isinstance(w, asyncio.Task) else asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        yield
    finally:
        for task, wait in zip(tasks, waits, strict=True):
            if task is not wait:
                task.cancel()


async def _drain(edge: Edge, force: asyncio.Event) -> None:
    """Not ready at once; the requests in flight get the grace; then the rest is cut."""
    grace_s = edge.config.shutdown_grace_s
    edge.draining = True
    log.info("shutting down: not ready; %d request(s) in flight get up to %.0f s", edge.in_flight(), grace_s)
    deadline = time.monotonic() + grace_s
    while edge.in_flight() and time.monotonic() < deadline and not force.is_set():
        await asyncio.sleep(0.05)
    edge.closing = True
    if edge.in_flight():
        log.warning("shutdown grace over: cutting %d request(s)", edge.in_flight())
        edge.cutting = True
        for task in list(edge.requests):
            task.cancel()
    deadline = time.monotonic() + CUT_SEND_TIMEOUT_S + 1.0
    while edge.requests and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def edge_error(path: str, status: int, message: str, type_: str, code: str) -> bytes:
    """An error body answered by the edge itself, in the shape of the path's API."""
    if api_of(endpoint_of(path)) == "anthropic":
        return orjson.dumps(anthropic_error_body(message, status))
    return orjson.dumps(error_body(message, type_, code))


def shutdown_event(message: str, endpoint: str = "chat") -> bytes:
    """The SSE event that ends a stream cut at shutdown, in the stream's API grammar."""
    return sse_error(message, "server_shutdown", "server_shutdown", api=endpoint)
