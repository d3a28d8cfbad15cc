"""A lean HTTP/1.1 client to the replicas: asyncio protocol + httptools, keep-alive pool.

Why not httpx here: per request, httpx (client, httpcore pool, h11, anyio streams,
cancel scopes) cost the gateway several times its own routing logic (a profile of a
small request: ~25% of the gateway's CPU in httpx/httpcore/h11/anyio, the routing itself
under 10%). The proxy's needs are narrow: POST the original body bytes to
``http://host:port/path`` over a kept-alive connection, hand back the status, the raw
headers and the body chunks as they arrive. That is what this module does, and only
that (no redirects, cookies, proxies, TLS, HTTP/2; a replica is a plain http URL).

Errors are httpx's exception types, so the proxy's failover logic is the same for both
clients: ``httpx.ConnectError`` / ``httpx.ConnectTimeout`` (cannot connect),
``httpx.ReadTimeout`` (no byte for ``read_timeout_s``), ``httpx.RemoteProtocolError``
(connection closed or malformed response). The objects returned mimic the part of
``httpx.Response`` the proxy uses (``status_code``, ``headers.get/raw``, ``aiter_raw``,
``aclose``), so the proxy keeps using httpx when a test injects a transport.

Connections: one pool of idle connections per ``host:port``; a connection goes back to
the pool only after a complete response on a keep-alive connection. Idle connections
expire after ``keepalive_expiry_s`` (default 4 s, under uvicorn's 5 s keep-alive
timeout, so the gateway never writes into a connection the replica is closing). A
reused connection that fails before any response byte is retried once on a new
connection (the replica closed it; the request was not processed).
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools
import httpx


class HeadersLike(Protocol):
    @property
    def raw(self) -> list[tuple[bytes, bytes]]: ...

    def get(self, name: str, default: str = "") -> str: ...


class ResponseLike(Protocol):
    """What the proxy reads of a response: ``httpx.Response`` and ``gateway.upstream``'s."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> HeadersLike: ...

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


READ_HIGH_WATER = 1 << 20  # pause reading from a replica beyond 1 MB not yet relayed


class RawHeaders:
    """The response headers as sent (``raw``), with a case-insensitive ``get``."""

    __slots__ = ("raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw

    def get(self, name: str, default: str = "") -> str:
        key = name.lower().encode("latin-1")
        for k, v in self.raw:
            if k.lower() == key:
                return v.decode("latin-1")
        return default


class Connection(asyncio.Protocol):
    """One kept-alive connection; parses one response at a time."""

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since_s = 0.0
        self._reset()

    def _reset(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.got_bytes = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed response from replica: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            self._fail(httpx.RemoteProtocolError("replica closed the connection"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > READ_HIGH_WATER and self.transport is not None:
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # only valid inside the callback
        self.complete = True
        self._wake()

    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout_s: float) -> None:
        """Until the protocol has news (headers, a chunk, the end, an error)."""
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout_s):
                await self.waiter
        except TimeoutError as exc:
            raise httpx.ReadTimeout(f"no data from replica for {timeout_s} s") from exc
        finally:
            self.waiter = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """One response being read from a connection (the subset of ``httpx.Response`` used)."""

    def __init__(self, pool: UpstreamPool, conn: Connection) -> None:
        self._pool = pool
        self._conn: Connection | None = conn
        self.status_code = conn.parser.get_status_code()
        self.headers = RawHeaders(conn.headers)

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        conn = self._conn
        assert conn is not None
        timeout_s = self._pool.read_timeout_s
        while True:
            if conn.chunks:
                chunk = conn.chunks.popleft()
                if conn.buffered > READ_HIGH_WATER >= conn.buffered - len(chunk) and conn.transport is not None:
                    conn.transport.resume_reading()
                conn.buffered -= len(chunk)
                yield chunk
            elif conn.complete:
                return
            elif conn.error is not None:
                raise conn.error
            else:
                await conn.wait(timeout_s)

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.complete and not conn.chunks and not conn.closed and conn.keep_alive:
            self._pool.release(conn)
        else:
            conn.close()


class UpstreamPool:
    """Kept-alive connections to the replicas, by ``host:port``."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float, max_idle_per_host: int = 64,
                 keepalive_expiry_s: float = 4.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_idle_per_host = max_idle_per_host
        self.keepalive_expiry_s = keepalive_expiry_s
        self._idle: dict[tuple[str, int], list[Connection]] = {}
        self._hosts: dict[str, tuple[tuple[str, int], bytes]] = {}

    def _target(self, base_url: str) -> tuple[tuple[str, int], bytes]:
        target = self._hosts.get(base_url)
        if target is None:
            parts = urlsplit(base_url)
            if parts.scheme != "http" or not parts.hostname:
                raise httpx.UnsupportedProtocol(f"replica URL must be http://host:port, got {base_url!r}")
            port = parts.port or 80
            if len(self._hosts) > 4096:
                self._hosts.clear()
            target = self._hosts[base_url] = ((parts.hostname, port), parts.netloc.encode("idna"))
        return target

    async def _connect(self, key: tuple[str, int]) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: Connection(key), key[0], key[1])
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connect to {key[0]}:{key[1]} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {key[0]}:{key[1]}: {exc}") from exc
        return conn

    def _take_idle(self, key: tuple[str, int]) -> Connection | None:
        idle = self._idle.get(key)
        now_s = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now_s - conn.idle_since_s < self.keepalive_expiry_s:
                return conn
            conn.close()
        return None

    def release(self, conn: Connection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= self.max_idle_per_host:
            conn.close()
            return
        conn.idle_since_s = time.monotonic()
        conn._reset()
        idle.append(conn)

    async def send(self, base_url: str, path: str, body: bytes,
                   headers: list[tuple[bytes, bytes]]) -> UpstreamResponse:
        """POST ``body`` to ``base_url + path``; returns once the response headers arrived."""
        key, host = self._target(base_url)
        lines = [b"POST ", path.encode("latin-1"), b" HTTP/1.1\r\nhost: ", host,
                 b"\r\ncontent-length: ", b"%d" % len(body), b"\r\n"]
        for name, value in headers:
            lines += (name, b": ", value, b"\r\n")
        lines.append(b"\r\n")
        head = b"".join(lines)
        conn = self._take_idle(key)
        if conn is not None:
            try:
                return await self._exchange(conn, head, body)
            except httpx.RemoteProtocolError:
                if conn.got_bytes:
                    raise
                # the replica closed the kept-alive connection: once more on a new one
        return await self._exchange(await self._connect(key), head, body)

    async def _exchange(self, conn: Connection, head: bytes, body: bytes) -> UpstreamResponse:
        assert conn.transport is not None
        try:
            conn.transport.writelines((head, body))
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(self.read_timeout_s)
        except BaseException:
            conn.close()
            raise
        return UpstreamResponse(self, conn)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
