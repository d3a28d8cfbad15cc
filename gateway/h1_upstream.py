"""The request path's own HTTP/1.1 client: asyncio Protocols and httptools, with push.

``H1Upstream`` implements ``gateway.upstream.Upstream`` (the proxy's contract) and adds
one capability aiohttp cannot give: after the first body chunk, a streamed answer can be
*pushed*. Each chunk the parser yields is handed to a sink from the connection's own
``data_received`` (no task wake-up, no future per chunk); the push relay
(``gateway/push_relay.py``) writes it into the client's transport there and then. Issue
15's profile: the pull model cost ~21-28 us of the ~85 us kvgate spent per relayed SSE
event, the push relay ~29-37 us for everything.

What the client keeps (the contract tests in tests/gateway/test_upstream.py run against
this client and aiohttp alike):

- **Pool bounds.** At most ``max_connections`` connections in use, at most
  ``max_connections_per_replica`` to one replica; a request over a bound waits, first
  come first served (the proxy's timeouts bound the wait). Idle connections count toward
  ``max_connections`` too (the file-descriptor budget of ``gateway/edge.py``): a new
  connection closes the longest-idle one of another replica when the total is reached.
  Idle connections close after ``keepalive_timeout_s`` (under SGLang's uvicorn 5 s).
- **Reuse only after a complete answer.** A connection goes back to the pool only when
  the final response was parsed to its end, the request was written out whole, the
  replica keeps the connection alive and the status is below 400 (an error answer may
  come before the replica read the body, whose unread rest would then be parsed as the
  next request: the kernel's buffers can hide that the body was not read). Anything else closes it: an unfinished or
  cancelled answer (the replica sees the disconnect, SGLang aborts the request), bytes
  after the answer or while idle (a desynchronised connection), a malformed answer.
- **Informational answers** (``100 Continue``, ``103 Early Hints``) are skipped; a
  ``101`` is an error (nothing is upgraded). The gateway never sends ``Expect``.
- **Bodies** framed by ``Content-Length``, chunked, or (no framing) read to the
  connection's close.
- **Bounds on the answer.** A response head over ``MAX_HEAD_BYTES`` is an error; a pulled
  body buffered past ``PAUSE_BYTES`` pauses reading from the replica until it is read.
- **Errors** as the hierarchy of ``gateway.upstream``: no connection (refused, timed
  out, bad URL) -> ``ConnectFailed``; a broken or malformed answer -> ``Disconnected``.
- The request carries exactly the caller's headers plus ``host`` and
  ``content-length`` (a caller's own framing headers are dropped); a header with CR, LF
  or NUL is refused (``Disconnected``) before anything is sent.

``https://`` replicas go through an ``AiohttpUpstream`` (TLS is not this client's).
"""
from __future__ import annotations

import asyncio
import logging
import re
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Protocol
from urllib.parse import urlsplit

import httptools

from gateway.upstream import (
    AiohttpUpstream,
    AnswerSink,
    ConnectFailed,
    Disconnected,
    RawHeaders,
    ResponseLike,
)
from gateway.upstream_config import UpstreamConfig

log = logging.getLogger("kvgate.upstream")

MAX_HEAD_BYTES = 64 * 1024  # a response head (status line and headers) at most
PAUSE_BYTES = 1024 * 1024  # a pulled body buffered beyond this pauses reading
FRAMING = frozenset({b"host", b"content-length", b"transfer-encoding", b"connection", b"expect"})
_FRAMED_BY = frozenset({b"content-length", b"transfer-encoding"})  # an answer's body ends by these, not the close
_BAD = re.compile(rb"[\r\n\0]").search  # in a value or the path: it could split the head
_BAD_NAME = re.compile(rb"[\r\n\0: \t]").search  # (a name with a space could be read as framing by a lenient server)


class PushSink(Protocol):
    """Where a pushed answer goes (``gateway/push_relay.py``)."""

    def chunk(self, data: bytes) -> None:
        """One body chunk, called from the connection's ``data_received``."""

    def end(self, error: BaseException | None) -> None:
        """The answer is complete (None), or broke (an ``UpstreamFailure``)."""


class _Replica:
    """One replica's pool: where to connect, idle connections (newest last), use count."""

    __slots__ = ("base", "busy", "host", "host_header", "idle", "port")

    def __init__(self, host: str, port: int, host_header: bytes, base: str = "") -> None:
        """``base``: the URL's own path, before the request's (as aiohttp's ``replica + path``)."""
        self.host, self.port, self.host_header, self.base = host, port, host_header, base
        self.idle: deque[_Connection] = deque()
        self.busy = 0


class H1Response:
    """A final response head and its body, pulled (``aiter_raw``) or pushed (``push``)."""

    __slots__ = ("_answer", "_buffered", "_chunks", "_conn", "_ended", "_error", "_settled", "_sink", "_waiter",
                 "answered", "headers", "status_code")

    def __init__(self, conn: _Connection, answer: AnswerSink | None = None) -> None:
        self._conn: _Connection | None = conn  # None once the answer is complete (the connection is free)
        self.status_code = 0
        self.headers = RawHeaders([])
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._ended = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sink: PushSink | None = None
        self._answer = answer  # offered the whole answer when it ends complete, until taken back
        self.answered: bytes | None = None  # the body, when ``_answer`` sent the answer on
        self._settled: Callable[[], None] | None = None  # ``when_settled``'s callback

    def answer_with(self, answer: AnswerSink) -> None:
        """Offer the whole answer to ``answer`` (as ``_Connection.request``'s ``answer``),
        attached after the request was written, in the same callback (before anything of the
        answer can be read)."""
        assert not self._ended
        self._answer = answer

    @property
    def ended(self) -> bool:
        """The answer ended: complete, or broken."""
        return self._ended

    def when_settled(self, callback: Callable[[], None]) -> None:
        """``callback`` is called once, soon after (``call_soon``: never inside the
        connection's callback) the answer ends, complete or broken, or its reading stops
        for want of a reader (the body buffered past ``PAUSE_BYTES``: only a puller takes
        it on from there). For an answer whose head came before its body."""
        assert not self._ended
        self._settled = callback
        if self._buffered > PAUSE_BYTES:  # reading stopped already (the head and the body came together)
            self._settle()

    def _settle(self) -> None:
        callback, self._settled = self._settled, None
        if callback is not None:
            asyncio.get_running_loop().call_soon(callback)

    # ---------------------------------------------------------------- from the connection
    def _body(self, data: bytes) -> None:
        sink = self._sink
        if sink is not None:
            try:
                sink.chunk(data)
            except Exception as exc:  # noqa: BLE001  # a bug in the sink: it must not break the connection's callback
                self._sink = None
                self._abort()
                sink.end(exc)
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > PAUSE_BYTES and self._conn is not None:
            self._conn.transport.pause_reading()
            self._settle()
        self._wake()

    def _finish(self, error: BaseException | None) -> None:
        """The answer ended (complete, or with ``error``); the connection is no longer ours."""
        if self._ended:
            return
        self._ended = True
        self._error = error
        self._conn = None
        answer, self._answer = self._answer, None
        if answer is not None and error is None and self._sink is None:
            data = self._joined()
            try:
                taken = answer(self.status_code, self.headers, data)
            except Exception:  # a bug in the sink must not break the connection's callback: the task sends it
                log.exception("the answer sink failed; the request's task sends the answer")
                taken = False
            if taken:
                self.answered = data
                self._chunks.clear()
                self._buffered = 0
        sink = self._sink
        if sink is not None:
            self._sink = None
            sink.end(error)
        self._wake()
        self._settle()

    def _joined(self) -> bytes:
        """The body buffered so far, kept as one chunk (joined once; none when empty)."""
        chunks = self._chunks
        if not chunks:
            return b""
        if len(chunks) > 1:
            data = b"".join(chunks)
            chunks.clear()
            chunks.append(data)
        return chunks[0]

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _abort(self) -> None:
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.abort()

    # ---------------------------------------------------------------- for the proxy
    def keep(self) -> None:
        """The caller takes the answer from here on: no longer offered to the answer sink."""
        self._answer = None

    def arrived(self) -> bytes | None:
        """The whole body when the answer has already ended complete (taken at once: no
        wait, so no timer), else None (still coming, broken, being pushed, or ``answered``)."""
        if not self._ended or self._error is not None or self._sink is not None or self.answered is not None:
            return None
        data = self._joined()
        self._chunks.clear()
        self._buffered = 0
        return data

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        while True:
            if self._chunks:
                data = self._chunks.popleft()
                self._buffered -= len(data)
                if self._buffered <= PAUSE_BYTES // 2 and self._conn is not None:
                    self._conn.transport.resume_reading()
                yield data
            elif self._ended:
                if self._error is not None:
                    raise self._error
                return
            else:
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None

    def push(self, sink: PushSink) -> None:
        """From now on every chunk goes to ``sink`` as it is parsed (those already
        buffered first, at once), and the end to ``sink.end``."""
        while self._chunks:
            data = self._chunks.popleft()
            sink.chunk(data)
        self._buffered = 0
        if self._ended:
            sink.end(self._error)
            return
        self._sink = sink
        if self._conn is not None:
            self._conn.transport.resume_reading()

    def unpush(self) -> None:
        """Stop pushing (the relay ended before the answer did)."""
        self._sink = None

    def pause_reading(self) -> None:
        """Stop reading from the replica (the client is not reading: flow control)."""
        if self._conn is not None:
            self._conn.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._conn is not None:
            self._conn.transport.resume_reading()

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """A complete answer's connection is back in the pool already; an unfinished one is closed."""
        self._sink = None
        self._abort()
        self._finish(Disconnected("response closed before its end"))


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a replica, parsing answers with httptools."""

    def __init__(self, upstream: H1Upstream, replica: _Replica) -> None:
        self.upstream, self.replica = upstream, replica
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set in connection_made
        self.parser = httptools.HttpResponseParser(self)
        self.response: H1Response | None = None  # the answer being read; None while idle
        self.head_bytes = 0
        self.raw: list[tuple[bytes, bytes]] = []
        self.informational = False
        self.headed = False  # the final head of this exchange arrived
        self.until_close = False  # no framing: the body ends when the connection does
        self.head: asyncio.Future[H1Response] | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.closed = False

    # ---------------------------------------------------------------- transport events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's TCPTransport is no asyncio.Transport)

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # nothing was asked: a desynchronised connection
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(Disconnected(f"malformed response: {exc}"))
            return
        if not self.headed and self.response is not None:  # (bytes past the head in this read do not count)
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES:
                self._fail(Disconnected(f"response head over {MAX_HEAD_BYTES} bytes"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_idle_timer()
        if self.response is not None:
            if self.headed and self.until_close and exc is None:
                self._end(None)  # a close-delimited body, read to its end
            else:
                reason = f"{type(exc).__name__}: {exc}" if exc else "connection closed before the answer was complete"
                self._fail(Disconnected(reason))
        self.upstream._lost(self)

    # ---------------------------------------------------------------- parser events
    def on_message_begin(self) -> None:
        if self.response is None:  # bytes after the answer, in the same read: out of step
            raise Disconnected("bytes after the answer")
        self.raw = []
        self.informational = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            if status == 101:
                raise Disconnected("the replica switched protocols")
            self.informational = True  # skipped; its message ends at once
            return
        response = self.response
        assert response is not None and self.head is not None
        self.headed = True
        response.status_code = status
        response.headers = RawHeaders(self.raw)
        framed = False
        for k, _ in self.raw:
            if k.lower() in _FRAMED_BY:
                framed = True
                break
        self.until_close = not framed and status not in (204, 304)
        if not self.head.done():
            self.head.set_result(response)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._body(body)

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            return
        # an error answer may come before the replica read the body (413, 400): the rest of
        # the body, unread, would be parsed as the next request, so its connection is closed
        reusable = (self.parser.should_keep_alive() and self.transport.get_write_buffer_size() == 0
                    and self.response is not None and self.response.status_code < 400)
        self._end(None)
        self.transport.resume_reading()  # (a pulled body may have paused it; the answer is all read)
        if reusable and not self.closed:
            self.upstream._release(self)
        else:
            self.abort()

    # ---------------------------------------------------------------- exchanges
    def request(self, wire: bytes, body: bytes, answer: AnswerSink | None = None) -> asyncio.Future[H1Response]:
        """Send one request; the future gets the final response head; ``answer`` is offered
        the whole answer when it ends complete (``H1Response.keep`` takes that back)."""
        self._cancel_idle_timer()
        if len(body) < 16384:  # written first (the replica starts on it); nothing comes back before this returns
            self.transport.write(wire + body)
        else:
            self.transport.write(wire)
            self.transport.write(body)
        self.response = H1Response(self, answer)
        self.headed = self.until_close = False
        self.head_bytes = 0
        self.head = asyncio.get_running_loop().create_future()
        return self.head

    def _end(self, error: BaseException | None) -> None:
        response, self.response = self.response, None
        head, self.head = self.head, None
        if head is not None and not head.done():
            head.set_exception(error or Disconnected("the answer ended before its head"))
            head.exception()  # retrieved: a sender that waits still gets it; one that left does not log it
        if response is not None:
            response._finish(error)

    def _fail(self, error: BaseException) -> None:
        self._end(error)
        self.abort()

    def abort(self) -> None:
        """Close now; the pool forgets the connection (``connection_lost`` follows). An
        answer still being read ends with ``Disconnected``."""
        if not self.closed:
            self.closed = True
            self._cancel_idle_timer()
            self._end(Disconnected("connection closed before the answer was complete"))
            self.transport.abort()
            self.upstream._lost(self)

    def idle_until(self, delay_s: float) -> None:
        self.idle_timer = asyncio.get_running_loop().call_later(delay_s, self.abort)

    def _cancel_idle_timer(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None


Sending = tuple["_Connection", bytes]  # an idle connection taken for a request, and the request's head


class H1Upstream:
    """The request path's client (see the module docstring). One per gateway process."""

    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self._replicas: dict[str, _Replica | None] = {}  # None: not http, the fallback's
        self._busy = 0  # connections in use or being opened
        self._idle = 0
        self._counted: set[_Connection] = set()  # connections counted in _busy or _idle
        self._waiters: deque[tuple[_Replica, asyncio.Future[None]]] = deque()
        self._fallback: AiohttpUpstream | None = None
        self._closed = False

    def _replica(self, url: str) -> _Replica | None:
        replica = self._replicas.get(url, False)
        if replica is not False:
            return replica  # type: ignore[return-value]
        try:
            parts = urlsplit(url)
            host, port = parts.hostname, parts.port
        except ValueError as exc:
            raise ConnectFailed(f"bad replica URL {url!r}: {exc}") from exc
        if parts.scheme == "https":
            found = None
        elif parts.scheme != "http" or not host:
            raise ConnectFailed(f"bad replica URL {url!r}")
        else:
            netloc = parts.netloc.rsplit("@", 1)[-1]
            found = _Replica(host, port or 80, netloc.encode("ascii") if netloc.isascii() else netloc.encode("idna"),
                             parts.path.rstrip("/"))
        if len(self._replicas) > 4096:
            self._replicas = {k: v for k, v in self._replicas.items() if v is not None and (v.busy or v.idle)}
        self._replicas[url] = found
        return found

    async def send(self, replica: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]],
                   answer: AnswerSink | None = None) -> ResponseLike:
        target = self._replica(replica)
        if target is None:
            if self._fallback is None:
                self._fallback = AiohttpUpstream(self.config)
            return await self._fallback.send(replica, path, body, headers)
        wire = _wire(b"POST", target.base + path, target.host_header, len(body), headers)
        return await self._exchange(target, wire, body, answer)

    async def get(self, replica: str, path: str) -> H1Response:
        """``GET replica + path`` (http:// only: probes, ``gateway/h1_probes.py``); returns
        once the final response head arrived."""
        target = self._replica(replica)
        if target is None:
            raise ConnectFailed(f"not an http:// replica: {replica!r}")
        return await self._exchange(target, _wire(b"GET", target.base + path, target.host_header, None, []), b"")

    async def _exchange(self, target: _Replica, wire: bytes, body: bytes,
                        answer: AnswerSink | None = None) -> H1Response:
        conn = await self._acquire(target)
        try:
            return await conn.request(wire, body, answer)
        except BaseException:
            conn.abort()  # cancelled or broken before the head: the replica sees the disconnect
            raise

    # ---------------------------------------------------------------- the pool
    def _room(self, replica: _Replica) -> bool:
        per = self.config.max_connections_per_replica
        return self._busy < self.config.max_connections and (per == 0 or replica.busy < per)

    async def _acquire(self, replica: _Replica) -> _Connection:
        """An idle connection to the replica (the most recent), a new one within the
        bounds, or a turn in the queue: a waiter woken but beaten to its connection
        waits again at the head of the queue."""
        woken = False
        while True:
            if self._closed:
                raise ConnectFailed("the gateway's client is closed")
            conn = self.take_idle(replica)
            if conn is not None:
                return conn
            if self._room(replica):
                return await self._connect(replica)
            waiter = asyncio.get_running_loop().create_future()
            if woken:
                self._waiters.appendleft((replica, waiter))
            else:
                self._waiters.append((replica, waiter))
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    self._wake(replica)  # woken, then cancelled: the turn passes on
                else:
                    try:
                        self._waiters.remove((replica, waiter))
                    except ValueError:
                        pass
                raise
            woken = True

    def take_idle(self, replica: _Replica) -> _Connection | None:
        """The replica's most recent idle connection, taken now (no wait), else None."""
        while replica.idle:
            conn = replica.idle.pop()
            self._idle -= 1
            if not conn.closed:
                self._busy += 1
                replica.busy += 1
                return conn
            self._counted.discard(conn)
        return None

    def sending_now(self, replica: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> Sending | None:
        """``send`` without waiting (the callbacks path, ``gateway.callback_path``): an idle
        connection to the replica, taken from the pool, and the request's head; None (nothing
        taken) when sending would wait (no idle connection), when this client does not send
        to the replica itself (https), or for a head that cannot be sent (``send`` refuses it)."""
        target = self._replica(replica)
        if target is None or self._closed or not target.idle:
            return None
        try:
            wire = _wire(b"POST", target.base + path, target.host_header, len(body), headers)
        except Disconnected:
            return None
        conn = self.take_idle(target)
        return None if conn is None else (conn, wire)

    async def _connect(self, replica: _Replica) -> _Connection:
        if self._busy + self._idle >= self.config.max_connections:
            self._close_an_idle()
        self._busy += 1
        replica.busy += 1
        conn = _Connection(self, replica)
        self._counted.add(conn)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                await loop.create_connection(lambda: conn, replica.host, replica.port)
        except (OSError, TimeoutError) as exc:
            self._lost(conn)
            raise ConnectFailed(f"cannot connect to {replica.host}:{replica.port}: {exc or type(exc).__name__}") \
                from exc
        except BaseException:
            self._lost(conn)
            if conn.transport is not None:
                conn.transport.abort()
            raise
        return conn

    def _close_an_idle(self) -> None:
        """Make room under ``max_connections``: close the longest-idle connection of the
        replica with the most idle ones."""
        most: _Replica | None = None
        for replica in self._replicas.values():
            if replica is not None and replica.idle and (most is None or len(replica.idle) > len(most.idle)):
                most = replica
        if most is not None:
            most.idle[0].abort()

    def _release(self, conn: _Connection) -> None:
        """A complete exchange: the connection waits in the pool for the next request."""
        replica = conn.replica
        self._busy -= 1
        replica.busy -= 1
        self._idle += 1
        replica.idle.append(conn)
        conn.idle_until(self.config.keepalive_timeout_s)
        self._wake(replica)

    def _lost(self, conn: _Connection) -> None:
        """The connection closed (or never opened): uncount it, wake a waiter."""
        if conn not in self._counted:
            return
        self._counted.discard(conn)
        replica = conn.replica
        try:
            replica.idle.remove(conn)
            self._idle -= 1
        except ValueError:
            self._busy -= 1
            replica.busy -= 1
        self._wake(replica)

    def _wake(self, freed: _Replica) -> None:
        """Wake the first waiter that can go now: for the freed replica's idle
        connection, or with room for a new one."""
        if self._closed:
            return
        for replica, waiter in self._waiters:
            if waiter.done():
                continue
            if (replica is freed and replica.idle) or self._room(replica):
                self._waiters.remove((replica, waiter))
                waiter.set_result(None)
                return

    async def close(self) -> None:
        self._closed = True
        for conn in list(self._counted):
            conn.abort()
        for _, waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(ConnectFailed("the gateway's client is closed"))
        self._waiters.clear()
        if self._fallback is not None:
            await self._fallback.close()


def _wire(method: bytes, path: str, host: bytes, length: int | None, headers: list[tuple[bytes, bytes]]) -> bytes:
    """The request head (``length`` None: no body, no ``content-length``); a header or
    path that could split it is refused."""
    target = path.encode("ascii", "strict") if path.isascii() else b""
    if not target.startswith(b"/") or b" " in target or _BAD(target):
        raise Disconnected(f"cannot send path {path!r}")
    parts = [method, b" ", target, b" HTTP/1.1\r\nhost: ", host, b"\r\n"]
    if length is not None:
        parts.append(b"content-length: %d\r\n" % length)
    names: list[bytes] = []
    values: list[bytes] = []
    for name, value in headers:
        if name.lower() in FRAMING:
            continue
        names.append(name)
        values.append(value)
        parts += (name, b": ", value, b"\r\n")
    # every name and value checked in two searches (joining adds no byte a search looks for)
    if not all(names) or _BAD_NAME(b"".join(names)) or _BAD(b"".join(values)):
        bad = next(n for n, v in zip(names, values, strict=True) if not n or _BAD_NAME(n) or _BAD(v))
        raise Disconnected(f"cannot send header {bad!r}")
    parts.append(b"\r\n")
    return b"".join(parts)
