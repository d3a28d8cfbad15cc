"""The gateway's HTTP server: uvicorn with the client edge's bounds and a graceful shutdown.

- ``gateway/edge.py``: per connection, the idle/header/body deadlines and the connection
  cap (``EdgeProtocol``), and the ``Edge`` state shared by the three parts.
- ``EdgeApp`` (ASGI front): the concurrency cap (503 OpenAI-shaped with ``Retry-After``;
  probes are never refused), the separate admin listener (``admin.port``: only
  ``/admin/*`` there, none of it on the main port), readiness false while shutting down,
  the end of cut requests, and an OpenAI-shaped 500 where uvicorn would answer plain text.
- ``GatewayServer`` (``uvicorn.Server``): on SIGTERM ``/ready`` turns 503 at once while
  the listeners stay open (a load balancer still sending gets answers), responses close
  their connections, requests in flight get ``shutdown_grace_s``; then the listeners
  close and whatever is still running is cut: an open SSE stream gets
  ``data: {"error": {... "type": "server_shutdown"}}`` and ``data: [DONE]``. Its main loop
  ticks once a second (uvicorn's: ten times), the signal handler ends the wait at once.

Everything is counted in ``GatewayMetrics`` (``client_connections``,
``client_connections_closed{reason}``, ``requests_rejected{reason}``,
``streams_cut_at_shutdown``). The one ``Edge`` per process is created by the server and
handed to the app through the ASGI lifespan state (``EDGE_KEY``), which works the same
in one process and in ``--workers`` children.
"""
from __future__ import annotations

import asyncio
import logging
import time
from asyncio import current_task
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson
from uvicorn.server import Server

from gateway.edge import CallbackTaker, Edge, EdgeServerState
from gateway.errors import anthropic_error_body, api_of, endpoint_of, error_body
from gateway.push_relay import ChunkWriter, edge_writer
from gateway.relay import SSE_MEDIA, sse_error

if TYPE_CHECKING:
    import socket
    from types import FrameType

    from starlette.types import ASGIApp, Message, Receive, Scope, Send
    from uvicorn.config import Config

    from gateway.metrics import GatewayMetrics

log = logging.getLogger("kvgate.server")
RESUME_EXTENSION = "kvgate.resume"  # scope extension: a request the callbacks path handed to its task
CUT_SEND_TIMEOUT_S = 2.0  # bound on writing the last event to a client that does not read
EDGE_KEY = "kvgate_edge"  # key of the Edge in the ASGI lifespan state
MAIN_LOOP_TICK_S = 1.0  # uvicorn's main loop wakes this often (its own: 0.1 s); a signal wakes it at once
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})  # never refused by the concurrency cap


class EdgeApp:
    """ASGI front: admin-port split, readiness while shutting down, the concurrency cap,
    and the end of requests cut at shutdown. Passes everything through until a
    ``GatewayServer`` hands it an ``Edge`` (unit tests over ``httpx.ASGITransport`` have none)."""

    def __init__(self, app: ASGIApp, metrics: Callable[[], GatewayMetrics | None],
                 callbacks: Callable[[], CallbackTaker | None] = lambda: None) -> None:
        """``metrics``, ``callbacks``: the app's metrics and callbacks path, read once its
        lifespan has started (``gateway.callback_path``; None: every request is a task)."""
        self.app = app
        self.metrics = metrics
        self.callbacks = callbacks
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
                edge.callbacks = self.callbacks()
                self.edge = edge
            await send(message)

        return lifespan_send

    def _refusal(self, edge: Edge, scope: Scope) -> tuple[int, bytes, bool] | None:
        """(status, body, retry-after) when the request is answered here, else None."""
        path: str = scope["path"]
        if edge.admin_port is not None:
            on_admin = (scope.get("server") or ("", None))[1] == edge.admin_port
            if on_admin != (path == "/admin" or path.startswith("/admin/")):
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

    async def _http(self, edge: Edge, scope: Scope, receive: Receive, send: Send) -> None:
        # (a request the callbacks path began was admitted there: it is sent upstream already)
        refusal = None if RESUME_EXTENSION in scope.get("extensions", {}) else self._refusal(edge, scope)
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
        relay = _Relay(send, edge, scope["path"], edge_writer(scope))
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
            await relay.send({"type": "http.response.body", "body": edge_error(
                scope["path"], 500, "internal gateway error", "internal_error", "internal_error")})
        finally:
            edge.active -= counted
            edge.requests.discard(task)


class _Relay:
    """Wraps ``send`` to see what the response is (SSE or not, started, complete)."""

    __slots__ = ("boundary", "done", "edge", "path", "pushed", "sse", "started", "upstream")

    def __init__(self, upstream: Send, edge: Edge, path: str, pushed: ChunkWriter | None = None) -> None:
        """``pushed``: the request's push relay writer (its bytes bypass ``send``)."""
        self.upstream, self.edge, self.path, self.pushed = upstream, edge, path, pushed
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
                    self.sse = value.startswith(SSE_MEDIA)
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
                                     "body": edge_error(self.path, 503, message, "server_shutdown",
                                                         "server_shutdown")})
                elif self.sse and not self.done:
                    # (one of the two paths wrote the body: both must say it ended between events)
                    boundary = self.boundary and (self.pushed is None or self.pushed.boundary)
                    body = (b"" if boundary else b"\n\n") + shutdown_event(message, endpoint_of(self.path))
                    await self.send({"type": "http.response.body", "body": body, "more_body": False})
                    if self.edge.metrics is not None:
                        self.edge.metrics.streams_cut_at_shutdown.inc()
        except (TimeoutError, OSError, RuntimeError) as exc:
            log.info("could not end a cut request: %s: %s", type(exc).__name__, exc)


class GatewayServer(Server):
    """uvicorn's server with the edge state, extra listeners and the graceful shutdown."""

    def __init__(self, config: Config, edge: Edge, tick_s: float = MAIN_LOOP_TICK_S) -> None:
        super().__init__(config)
        self.edge = edge
        self.server_state = EdgeServerState(edge)
        self.tick_s = tick_s
        self._tick: asyncio.Future[None] | None = None  # the main loop's current wait

    async def main_loop(self) -> None:
        """uvicorn's main loop (the date header, ``should_exit``), woken every ``tick_s``
        instead of ten times a second: an idle wake-up costs ~0.15 ms of CPU here. A
        signal (``handle_exit``) ends the wait at once, so shutdown starts as soon."""
        loop = asyncio.get_running_loop()
        per_tick = max(1, round(self.tick_s * 10))  # uvicorn's on_tick counts 0.1 s ticks
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + per_tick) % 864000
            self._tick = tick = loop.create_future()
            timer = loop.call_later(self.tick_s, _resolve, tick)
            await tick
            timer.cancel()
            should_exit = await self.on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        tick = self._tick
        # (a signal handler runs between bytecodes: wake the loop safely; a wait that is
        # over already means the main loop has ended, and its event loop may be closed)
        if tick is not None and not tick.done():
            tick.get_loop().call_soon_threadsafe(_resolve, tick)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.lifespan.state[EDGE_KEY] = self.edge  # the app finds the edge in its lifespan state
        await super().startup(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        edge = self.edge
        grace_s = edge.config.shutdown_grace_s
        edge.draining = True
        log.info("shutting down: not ready; %d request(s) in flight get up to %.0f s", edge.in_flight(), grace_s)
        # idle keep-alive connections stay open (closing them races with a client reusing
        # one); responses from now on close theirs (EdgeApp adds "Connection: close")
        deadline = time.monotonic() + grace_s
        while edge.in_flight() and time.monotonic() < deadline and not self.force_exit:
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
        """End what is still running: streams get their last event (``EdgeApp``), a
        request on the callbacks path its 503 (``gateway.callback_path.Flight.cut``)."""
        if edge.in_flight():
            flights = list(edge.callbacks.flights if edge.callbacks is not None else ())
            log.warning("shutdown grace over: cutting %d request(s) (%d on the callbacks path)", edge.in_flight(),
                        len(flights))
            edge.cutting = True
            for task in list(edge.requests):
                task.cancel()
            for flight in flights:
                flight.cut()
        deadline = time.monotonic() + CUT_SEND_TIMEOUT_S + 1.0
        while (edge.requests or self.server_state.tasks) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for task in self.server_state.tasks:
            task.cancel()
        while self.server_state.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.02)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def edge_error(path: str, status: int, message: str, type_: str, code: str) -> bytes:
    """An error body answered by the edge itself, in the shape of the path's API."""
    if api_of(endpoint_of(path)) == "anthropic":
        return orjson.dumps(anthropic_error_body(message, status))
    return orjson.dumps(error_body(message, type_, code))


def shutdown_event(message: str, endpoint: str = "chat") -> bytes:
    """The SSE event that ends a stream cut at shutdown, in the stream's API grammar."""
    return sse_error(message, "server_shutdown", "server_shutdown", api=endpoint)
