"""The floor of a Python gateway below ASGI: a pass-through proxy on asyncio Protocols.

`kvgate bench peers` (and ``--overhead``, and ``tools/bench/relay_floor.py``) can run this as
its target ``python-floor-protocol``. It is the design a Python data plane would take to
drop the server and client stack that ``python-floor`` (uvicorn + aiohttp) measures:

- one ``asyncio.Protocol`` per client connection, the request parsed by ``httptools`` in
  its ``data_received`` callbacks (no ASGI scope, no messages, no task per request);
- one ``asyncio.Protocol`` per upstream connection, kept alive in a pool per replica, the
  answer parsed by ``httptools`` and written into the client's transport from the
  upstream's ``data_received``: a relayed SSE event costs one read, one parse, one write,
  and no task wake-up;
- the replica chosen as ``python-floor`` chooses it (the same session, the same replica).

No routing beyond that, no index, no safety: no deadlines, no body cap, no flow control
(a slow client's bytes queue in its transport), no pipelining (one request per connection
at a time; the bench's clients do not pipeline). It exists only to be measured: what
remains of a Python gateway's cost when its HTTP work is done in protocol callbacks.

``python-floor-protocol-aiohttp`` (``--client aiohttp``) keeps this server and sends upstream
through ``aiohttp`` as ``python-floor`` does: the two rows split the stack's cost between
its server side (uvicorn's ASGI) and its client side (aiohttp). ``python-floor-protocol-pull``
(``--client pull``) keeps the Protocol client but hands each chunk to a task through a
future, as a pull-model client does: it splits the client side's cost between the task
wake-ups and aiohttp's own code.

    python -m loadtest.peers.protocol_floor --port 31900 --replica http://127.0.0.1:31001 [--replica ...] [--client pull|aiohttp]
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from http import HTTPStatus
from typing import NamedTuple, Protocol

import aiohttp
import httptools
import uvloop
from multidict import CIMultiDict

from loadtest.h1_server import RequestParsing
from loadtest.peers.python_floor import HOP, SESSION_HEADER, Replicas, floor_parser

REASONS = {s.value: s.phrase.encode("latin-1") for s in HTTPStatus}


class Request(NamedTuple):
    """A client's request as the Front parsed it (hop-by-hop headers and Host left out)."""

    method: bytes
    url: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


class Sink(Protocol):
    """Where an upstream connection writes the answer it relays (a ``Front``, a ``PullSink``)."""

    def write(self, data: bytes) -> None: ...

    def done(self, close: bool) -> None: ...


class Pool:
    """Idle keep-alive connections to one replica."""

    def __init__(self, url: str) -> None:
        hostport = url.removeprefix("http://").rstrip("/")
        host, _, port = hostport.partition(":")
        self.host, self.port, self.host_header = host, int(port or 80), b"host: " + hostport.encode() + b"\r\n"
        self.idle: list[UpstreamConnection] = []

    def wire(self, request: Request) -> list[bytes]:
        """The request's bytes for this replica: its head, then its body."""
        headers = b"".join(b"%s: %s\r\n" % pair for pair in request.headers)
        return [b"%s %s HTTP/1.1\r\n%s%scontent-length: %d\r\n\r\n" % (
            request.method, request.url, self.host_header, headers, len(request.body)), request.body]

    def send(self, front: Sink, request: Request) -> None:
        while self.idle:
            up = self.idle.pop()
            if not up.closed:
                up.start(front, request, reused=True)
                return
        asyncio.ensure_future(self._connect(front, request))

    async def _connect(self, front: Sink, request: Request) -> None:
        try:
            _, up = await asyncio.get_running_loop().create_connection(lambda: UpstreamConnection(self), self.host, self.port)
        except OSError:
            front.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
            front.done(True)
            return
        up.start(front, request)


class AiohttpPool:
    """``--client aiohttp``: the same server, the upstream through one ``aiohttp`` session
    (kvgate's client): a task per request, one wake-up of it per relayed chunk. What the
    server side alone saves, with the client kept."""

    session: aiohttp.ClientSession | None = None

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def send(self, front: Front, request: Request) -> None:
        asyncio.ensure_future(self._relay(front, request))

    async def _relay(self, front: Front, request: Request) -> None:
        if AiohttpPool.session is None:
            AiohttpPool.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=256), cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False, skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
                trust_env=False)
        headers = CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers)
        try:
            async with AiohttpPool.session.post(self.url + request.url.decode("latin-1"), data=request.body,
                                                headers=headers) as answer:
                out = [b"HTTP/1.1 %d %s\r\n" % (answer.status, REASONS.get(answer.status, b""))]
                out += [k + b": " + v + b"\r\n" for k, v in answer.raw_headers if k.lower() not in HOP]
                front.write(b"".join(out) + b"transfer-encoding: chunked\r\n\r\n")
                async for chunk in answer.content.iter_any():
                    front.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                front.write(b"0\r\n\r\n")
        except aiohttp.ClientError:
            front.done(True)
            return
        front.done(False)


class PullPool(Pool):
    """``--client pull``: the Protocol client, but its answer handed to a task per request
    through a future per chunk, as a pull-model client (aiohttp's ``StreamReader``) does:
    what the task wake-ups cost without aiohttp's own code."""

    def send(self, front: Sink, request: Request) -> None:
        super().send(front if isinstance(front, PullSink) else PullSink(front), request)  # a resend keeps its sink


class PullSink:
    """Takes an answer's bytes as ``UpstreamConnection`` writes them; a task of its own relays them."""

    def __init__(self, front: Sink) -> None:
        self.front = front
        self.parts: list[bytes] = []
        self.ended: bool | None = None  # None: going on; else close the client's connection
        self.waiter: asyncio.Future[None] | None = None
        asyncio.ensure_future(self._relay())

    def write(self, data: bytes) -> None:
        self.parts.append(data)
        self._wake()

    def done(self, close: bool) -> None:
        self.ended = close
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def _relay(self) -> None:
        while True:
            if not self.parts and self.ended is None:
                self.waiter = asyncio.get_running_loop().create_future()
                await self.waiter
            if self.parts:
                data, self.parts = b"".join(self.parts), []
                self.front.write(data)
            if self.ended is not None and not self.parts:
                self.front.done(self.ended)
                return


class UpstreamConnection(asyncio.Protocol):
    """One connection to a replica: sends one request at a time, relays its answer."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.front: Sink | None = None
        self.request: Request | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunked = self.answered = self.closed = self.reused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def start(self, front: Sink, request: Request, reused: bool = False) -> None:
        assert self.transport is not None
        self.front, self.request, self.answered, self.reused = front, request, False, reused
        self.transport.writelines(self.pool.wire(request))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        assert self.front is not None
        status = self.parser.get_status_code()
        head = [b"HTTP/1.1 %d %s\r\n" % (status, REASONS.get(status, b""))]
        length = None
        for name, value in self.headers:
            lower = name.lower()
            if lower == b"content-length":
                length = value
            elif lower not in HOP:
                head.append(name + b": " + value + b"\r\n")
        self.headers = []
        self.chunked = length is None
        head.append(b"transfer-encoding: chunked\r\n\r\n" if length is None else b"content-length: " + length + b"\r\n\r\n")
        self.answered = True
        self.front.write(b"".join(head))

    def on_body(self, body: bytes) -> None:
        assert self.front is not None
        self.front.write(b"%x\r\n%s\r\n" % (len(body), body) if self.chunked else body)

    def on_message_complete(self) -> None:
        front, self.front = self.front, None
        assert front is not None
        if self.chunked:
            front.write(b"0\r\n\r\n")
        if self.parser.should_keep_alive():
            self.pool.idle.append(self)
        else:
            self.closed = True
            assert self.transport is not None
            self.transport.close()
        front.done(False)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        front, self.front = self.front, None
        if front is None:
            return
        if not self.answered and self.reused and self.request is not None:  # a kept-alive one closed: send again
            self.pool.send(front, self.request)
        else:
            front.done(True)


class Front(RequestParsing):
    """One client connection: parses a request, hands it to a replica's pool."""

    def __init__(self, replicas: Replicas[Pool] | Replicas[AiohttpPool]) -> None:
        super().__init__()
        self.replicas = replicas
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.session = b""

    def bad_request(self) -> None:
        self.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        self.done(True)

    def on_message_begin(self) -> None:
        self.url, self.headers, self.body, self.session = b"", [], [], b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == SESSION_HEADER:
            self.session = value
        if lower not in HOP:
            self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        self.transport.pause_reading()
        if self.url == b"/health":
            self.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            self.done(False)
            return
        request = Request(self.parser.get_method(), self.url, self.headers, b"".join(self.body))
        self.replicas.pick(self.session).send(self, request)

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def done(self, close: bool) -> None:
        assert self.transport is not None
        if close or not self.parser.should_keep_alive():
            self.transport.close()
        else:
            self.transport.resume_reading()


def main(argv: Sequence[str] | None = None) -> None:
    parser = floor_parser(__doc__)
    parser.add_argument("--client", choices=("protocol", "pull", "aiohttp"), default="protocol")
    args = parser.parse_args(argv)
    replicas: Replicas[Pool] | Replicas[AiohttpPool]
    if args.client == "protocol":
        replicas = Replicas([Pool(url) for url in args.replica])
    elif args.client == "pull":
        replicas = Replicas[Pool]([PullPool(url) for url in args.replica])
    else:
        replicas = Replicas([AiohttpPool(url) for url in args.replica])

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(lambda: Front(replicas), args.host, args.port)
        async with server:
            await server.serve_forever()

    uvloop.run(serve())


if __name__ == "__main__":
    main()
