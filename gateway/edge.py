"""The gateway's client edge, per connection: deadlines and the connection cap.

uvicorn arms its keep-alive timer only after a response, so a connection that never
finishes a request is never closed. ``EdgeProtocol`` (uvicorn's httptools protocol,
subclassed) closes a connection that sends nothing after ``server.idle_timeout_s``;
headers not complete within ``header_timeout_s`` of their first byte -> 408 and close; a
body not complete within ``body_timeout_s`` of the headers -> 408, close, and the app
sees ``http.disconnect``. At ``max_connections`` a new connection evicts the longest-idle
one (no request in progress; as nginx reuses idle keep-alive connections) and is refused
with 503 only when none is idle, so ``/ready`` answers with thousands of idle sockets
open. Parser rejections (ambiguous framing, bad syntax) get an OpenAI-shaped 400. Each
request's scope carries the push relay's ``ChunkWriter`` (``gateway/push_relay.py``), and
the connection tells that relay when the client's transport pauses and resumes writing.
The header and body clocks are armed when a read's parsing ends, unless it got past them.
An inference ``POST`` (its path exactly an endpoint's, no ``Expect: 100-continue``, not
behind another request of the connection) is held (``HeldCycle``): no ASGI scope, cycle,
event or task is made for it while its body comes (at most ``DEFER_MAX_BYTES``), and it is
offered to the callbacks path (``gateway/callback_path.py``) from ``on_message_complete``.
The path answers it through the request's ``ChunkWriter``, or starts its task, which
builds uvicorn's scope and cycle then (``EdgeProtocol._start_held``: the same scope and
cycle uvicorn builds, tested against it); a larger body, or the connection lost
meanwhile, starts the task too (it reads the body, or the disconnect).

``Edge`` is the state of one process's client edge that the protocol, the ASGI front and
the server share (``gateway/server.py``). ``connection_limit`` clamps
``server.max_connections`` below the open-file limit.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import resource
from asyncio import TimerHandle
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, Protocol, cast

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from gateway.errors import error_body
from gateway.push_relay import PUSH_EXTENSION, ChunkWriter, WritingListener
from gateway.settings import ServerConfig

if TYPE_CHECKING:
    from uvicorn._types import HTTPScope
    from uvicorn.config import Config
    from uvicorn.protocols.http.flow_control import FlowControl

    from gateway.metrics import GatewayMetrics
    from gateway.settings import Settings

log = logging.getLogger("kvgate.server")
FD_MARGIN = 64  # files, Redis, listeners, logs beside client and upstream connections
DEFER_MAX_BYTES = 64 * 1024  # uvicorn's HIGH_WATER_LIMIT: beyond it reading pauses until the task reads the body


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


def error_bytes(message: str, type_: str, code: str) -> bytes:
    return orjson.dumps(error_body(message, type_, code))


def raw_response(status: int, body: bytes, *, retry_after: bool = False) -> bytes:
    """A complete ``Connection: close`` JSON response, written by the protocol itself."""
    reason = {400: b"Bad Request", 408: b"Request Timeout", 503: b"Service Unavailable"}.get(status, b"Error")
    extra = b"retry-after: 1\r\n" if retry_after else b""
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s"
            b"connection: close\r\n\r\n%s" % (status, reason, len(body), extra, body))


class Cuttable(Protocol):
    def cut(self) -> None:
        """The shutdown grace is over: end the request now."""


StartTask = Callable[[dict[str, object]], None]  # starts a held request's ASGI task, with these scope extensions


class CallbackTaker(Protocol):
    """What the edge asks of the callbacks path (``gateway.callback_path.CallbackPath``)."""

    @property
    def flights(self) -> Collection[Cuttable]:
        """Requests on the path now (the shutdown waits for them, then cuts them)."""

    @property
    def urls(self) -> Collection[bytes]:
        """The request targets whose ``POST`` is held until its body is complete, then ``take``n."""

    def take(self, edge: Edge, held: HeldCycle, writer: ChunkWriter, start_task: StartTask) -> bool:
        """Route and send it now, or hand it to its task (``start_task``); False: nothing done."""


class _NoEvent:
    """A held request's ``message_event``: nothing waits on it (it has no task yet)."""

    __slots__ = ()

    def set(self) -> None:
        pass


NO_EVENT = _NoEvent()


class HeldCycle:
    """A request held for the callbacks path: what ``ChunkWriter`` and uvicorn's protocol
    read of a ``RequestResponseCycle`` (the response's state, the connection's), and the
    request as the path reads it. Its ASGI scope and cycle are built only if it goes to a
    task (``EdgeProtocol._start_held``), from then on the writer's and the protocol's.
    (No ``__slots__``: the response's state starts as these class defaults, so a held
    request costs seven assignments.)"""

    message_event = NO_EVENT
    scope = None  # (no scope: ``ChunkWriter.detach`` has nothing to take out)
    more_body = True
    size = 0  # bytes of body so far
    disconnected = False
    response_started = False
    response_complete = False
    chunked_encoding: bool | None = None  # (the response state ChunkWriter.answer sets, as uvicorn's)
    waiting_for_100_continue = False
    expected_content_length = 0

    def __init__(self, protocol: EdgeProtocol, url: bytes, headers: list[tuple[bytes, bytes]], http_version: str,
                 keep_alive: bool) -> None:
        self.protocol = protocol
        self.url, self.headers, self.http_version, self.keep_alive = url, headers, http_version, keep_alive
        self.path = url.decode("ascii")  # (a target of ``CallbackTaker.urls``: ASCII)
        self.parts: list[bytes] = []

    # the connection's, as a cycle has them
    @property
    def transport(self) -> asyncio.Transport:
        return self.protocol.transport

    @property
    def flow(self) -> FlowControl:
        return self.protocol.flow

    @property
    def default_headers(self) -> list[tuple[bytes, bytes]]:
        return self.protocol.server_state.default_headers

    def on_response(self) -> None:
        self.protocol.on_response_complete()

    @property
    def client(self) -> tuple[str, int] | None:
        return self.protocol.client

    @property
    def server(self) -> tuple[str, int | None] | None:
        return self.protocol.server

    @property
    def scheme(self) -> str:
        return self.protocol.scheme or "http"

    @property
    def body(self) -> bytes:
        """The body so far (one chunk: no copy)."""
        parts = self.parts
        if len(parts) > 1:
            parts[:] = [b"".join(parts)]
        return parts[0] if parts else b""

    def add(self, chunk: bytes) -> None:
        self.parts.append(chunk)
        self.size += len(chunk)


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
        self.callbacks: CallbackTaker | None = None  # the callbacks path (bound at start-up; None: off)

    def in_flight(self) -> int:
        """Requests in progress: ASGI tasks and requests on the callbacks path."""
        return len(self.requests) + (len(self.callbacks.flights) if self.callbacks is not None else 0)

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
        self.wanted: str | None = None  # a deadline to arm once the current read is parsed (``_want``)
        self.busy = False  # a request is in progress (first byte .. response complete)
        self.counted = False
        self.writing_listener: WritingListener | None = None  # a push relay's flow control
        self.writers: list[ChunkWriter] = []  # of the requests whose response is not complete
        self.held: HeldCycle | None = None  # a request held for the callbacks path, its body still coming
        self.held_writer: ChunkWriter | None = None  # its writer (the held cycle does not name it: no cycle)
        self.took = False  # the callbacks path took (or handed on) a request in this read

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
        if self.held is not None and self.held_writer is not None:  # a body that never ended: its task reads
            self.held.disconnected = True  # the disconnect (a 499), as before
            self._start_held(self.held, self.held_writer)
        writers, self.writers = self.writers, []
        for writer in writers:  # every request of the connection (uvicorn marks only the last one parsed)
            writer.client_lost()

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

    def _want(self, reason: str) -> None:
        """The header or body clock starts: its timer is armed when this read's parsing
        ends, unless the parsing got past it (no timer armed and cancelled for a request
        that arrived in one read; the clock starts those microseconds later)."""
        self._disarm()
        self.wanted = reason

    def _arm_wanted(self) -> None:
        reason, self.wanted = self.wanted, None
        if reason is not None and not self.transport.is_closing():
            config = self.edge.config
            self._arm(config.header_timeout_s if reason == "header_timeout" else config.body_timeout_s, reason)

    def _disarm(self) -> None:
        self.wanted = None
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
            self._want("header_timeout")
        super().data_received(data)
        self._arm_wanted()
        if self.took:  # reading on, as a task's first receive() does: a request pipelined behind the
            self.took = False  # one taken paused it, and a paused transport never sees the client leave
            self.flow.resume_reading()

    def on_message_begin(self) -> None:
        # uvicorn's, but the ASGI scope is built when the head is complete, for a request that needs one
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        if self.deadline is None and self.wanted is None:  # a pipelined request behind the one just parsed
            self._want("header_timeout")

    def _scope(self) -> HTTPScope:
        """The scope uvicorn's ``on_message_begin`` makes (checked against it by
        ``tests/gateway/test_edge_held.py``)."""
        scope: dict[str, Any] = {  # (uvicorn's own literal; method and path are added with the head)
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
        }
        return cast("HTTPScope", scope)

    def on_headers_complete(self) -> None:
        self._disarm()
        if self._hold():
            self._want("body_timeout")
            return
        self.scope = self._scope()
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # (not an upgrade): the push relay's writer
            writer = ChunkWriter(cycle, self._listen, self._draining)
            self.writers.append(writer)
            self.scope["extensions"] = {PUSH_EXTENSION: writer}  # type: ignore[dict-item]
        if not self.transport.is_closing() and not self.pipeline:  # a queued request waits its turn
            self._want("body_timeout")

    def _hold(self) -> bool:
        """Hold the request for the callbacks path (``HeldCycle``) when the path may take
        it: a ``POST`` to one of its targets exactly (no query), no ``Expect:
        100-continue``, not an upgrade, no response of this connection in progress (a
        pipelined request waits in uvicorn's queue and goes the task path), and none of
        the uvicorn settings that change a request's app or path (``limit_concurrency``,
        ``root_path``)."""
        callbacks = self.edge.callbacks
        if callbacks is None or self.expect_100_continue or self.url not in callbacks.urls:
            return False
        parser = self.parser
        current = self.cycle
        if (parser.get_method() != b"POST" or parser.should_upgrade()
                or (current is not None and not current.response_complete)
                or self.limit_concurrency is not None or self.root_path):
            return False
        version = parser.get_http_version()
        held = HeldCycle(self, self.url, self.headers, version, version != "1.0" and parser.should_keep_alive())
        self.held = held
        self.cycle = held  # type: ignore[assignment]  # (what uvicorn's protocol reads of it, HeldCycle has)
        self.held_writer = writer = ChunkWriter(held, self._listen, self._draining)
        self.writers.append(writer)
        return True

    def _start_held(self, held: HeldCycle, writer: ChunkWriter, extensions: dict[str, object] | None = None) -> None:
        """The held request goes to its ASGI task: uvicorn's scope and cycle for it (as its
        ``on_headers_complete`` makes them), the body so far, the writer's state; the
        writer and the protocol go on with that cycle."""
        scope = self._scope()
        scope["headers"] = held.headers
        if held.http_version != "1.1":
            scope["http_version"] = held.http_version
        scope["method"] = "POST"
        scope["path"] = held.path
        scope["raw_path"] = held.url
        scope["query_string"] = b""
        scope["extensions"] = {PUSH_EXTENSION: writer, **(extensions or {})}  # type: ignore[dict-item]
        cycle = RequestResponseCycle(
            scope=scope, transport=self.transport, flow=self.flow, logger=self.logger,
            access_logger=self.access_logger, access_log=self.access_log,
            default_headers=self.server_state.default_headers, message_event=asyncio.Event(),
            expect_100_continue=False, keep_alive=held.keep_alive, on_response=self.on_response_complete)
        assert not held.response_started, "a held request's response goes through its writer or its task"
        cycle.body = bytearray(held.body)
        cycle.more_body = held.more_body
        cycle.disconnected = held.disconnected
        cycle.message_event.set()  # (its receive() reads what is there, or the disconnect)
        writer.cycle = cycle
        if cast("object", self.cycle) is held:  # (else a request pipelined behind it is the protocol's current one)
            self.cycle = cycle
        if self.held is held:  # (its body still coming: uvicorn's on_body and on_message_complete go on)
            self.held = self.held_writer = None
        self._start_asgi_task(cycle, self.app)

    def _draining(self) -> bool:
        return self.edge.draining

    def _listen(self, listener: WritingListener | None) -> None:
        self.writing_listener = listener

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.writing_listener is not None:
            self.writing_listener(False)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.writing_listener is not None:
            self.writing_listener(True)

    def on_body(self, body: bytes) -> None:
        held = self.held
        if held is None:
            super().on_body(body)
            return
        held.add(body)
        if held.size > DEFER_MAX_BYTES:
            assert self.held_writer is not None
            self._start_held(held, self.held_writer)  # a large body: the task reads it (uvicorn pauses reading beyond this)

    def on_message_complete(self) -> None:
        self._disarm()
        held = self.held
        if held is None:
            super().on_message_complete()
            return
        writer = self.held_writer
        assert writer is not None
        self.held = self.held_writer = None
        held.more_body = False
        callbacks = self.edge.callbacks
        if (callbacks is None or held.disconnected
                or not callbacks.take(self.edge, held, writer, functools.partial(self._start_held, held, writer))):
            self._start_held(held, writer)
        else:
            self.took = True

    def on_response_complete(self) -> None:
        kept = []
        for writer in self.writers:
            if writer.cycle.response_complete:
                writer.detach()  # (its scope, cycle and writer then go by reference counting)
            else:
                kept.append(writer)
        self.writers = kept
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
