"""gateway.h1_upstream.H1Upstream beyond the shared contract of tests/gateway/test_upstream.py: the pool's
bounds, reuse only after a complete answer, the bounds on an answer, header safety, the parser (fuzzed with
hypothesis through a stub transport) and push. Behaviour tests run against tiny asyncio servers on 127.0.0.1."""
from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.h1_upstream import (
    FRAMING,
    MAX_HEAD_BYTES,
    PAUSE_BYTES,
    H1Response,
    H1Upstream,
    _Connection,
    _Replica,
    _wire,
)
from gateway.upstream import ConnectFailed, Disconnected, HeadersLike
from gateway.upstream_config import UpstreamConfig

WAIT_S = 5.0  # the bound of every wait that should end at once or soon

# ---------------------------------------------------------------------------------------- loop errors

@pytest.fixture(autouse=True)
async def no_loop_errors() -> AsyncIterator[None]:
    """Nothing reaches the loop's exception handler (an exception escaping ``data_received``, a callback
    that raised, a future's exception never retrieved while the test ran)."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    try:
        yield
    finally:
        loop.set_exception_handler(previous)
    assert not errors, [context.get("message") for context in errors]


# ---------------------------------------------------------------------------------------- the fake replica

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class FakeReplica:
    """What the server saw: connections accepted, open at once (at most), and per connection an event set
    when its handler ended (the client closed it, or the handler returned)."""

    def __init__(self) -> None:
        self.url = ""
        self.port = 0
        self.accepted = 0
        self.open_now = 0
        self.max_open = 0
        self.done: list[asyncio.Event] = []
        self.heads: list[bytes] = []  # every request head read by read_request, in order


@asynccontextmanager
async def fake_replica(handler: Handler) -> AsyncIterator[FakeReplica]:
    state = FakeReplica()
    tasks: set[asyncio.Task[Any]] = set()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        index = state.accepted
        state.accepted += 1
        state.open_now += 1
        state.max_open = max(state.max_open, state.open_now)
        state.done.append(asyncio.Event())
        try:
            await handler(reader, writer, index)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            state.open_now -= 1
            state.done[index].set()
            writer.close()

    srv = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    state.port = srv.sockets[0].getsockname()[1]
    state.url = f"http://127.0.0.1:{state.port}"
    try:
        yield state
    finally:
        srv.close()
        for task in tasks:
            task.cancel()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT_S)
        await asyncio.wait_for(srv.wait_closed(), WAIT_S)


def header_values(head: bytes, name: bytes) -> list[bytes]:
    return [line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")[1:]
            if b":" in line and line.split(b":", 1)[0].strip().lower() == name]


async def read_request(reader: asyncio.StreamReader, state: FakeReplica | None = None) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    if state is not None:
        state.heads.append(head)
    length = int(header_values(head, b"content-length")[0])
    return head, await reader.readexactly(length)


def answer(body: bytes, status: bytes = b"200 OK") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body)


async def until_eof(reader: asyncio.StreamReader) -> None:
    while await reader.read(65536):
        pass


def head_then_body(body: bytes, then: Handler | None = None) -> Handler:
    """A replica answering with ``body`` (with its length): the head alone, the body 50 ms
    later; then ``then`` serves the connection (default: nothing, until the gateway closes it)."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body))
        await writer.drain()
        await asyncio.sleep(0.05)  # the head arrives alone
        writer.write(body)
        await writer.drain()
        await (until_eof(reader) if then is None else then(reader, writer, index))
    return serve


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
    while True:
        _, body = await read_request(reader)
        writer.write(answer(body))
        await writer.drain()


# ---------------------------------------------------------------------------------------- the client side

@asynccontextmanager
async def h1(**config: Any) -> AsyncIterator[H1Upstream]:
    pool = H1Upstream(UpstreamConfig(connect_timeout_s=WAIT_S, **config))
    try:
        yield pool
    finally:
        await pool.close()


async def send(pool: H1Upstream, url: str, body: bytes,
               headers: Iterable[tuple[bytes, bytes]] = ()) -> H1Response:
    response = await asyncio.wait_for(pool.send(url, "/v1/x", body, list(headers)), WAIT_S)
    assert isinstance(response, H1Response)
    return response


async def read_body(response: H1Response) -> bytes:
    async def pull() -> bytes:
        return b"".join([chunk async for chunk in response.aiter_raw()])
    try:
        return await asyncio.wait_for(pull(), WAIT_S)
    finally:
        await response.aclose()


async def fetch(pool: H1Upstream, url: str, body: bytes,
                headers: Iterable[tuple[bytes, bytes]] = ()) -> tuple[int, bytes]:
    response = await send(pool, url, body, headers)
    return response.status_code, await read_body(response)


def pull(response: H1Response) -> AsyncGenerator[bytes, None]:
    """The pull iterator, typed as what it is (it is closed with ``aclose``)."""
    chunks = response.aiter_raw()
    assert isinstance(chunks, AsyncGenerator)
    return chunks


async def eventually(condition: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.005)
    await asyncio.wait_for(poll(), timeout_s)


class Sink:
    """A push sink that records what it was given."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.errors: list[BaseException | None] = []
        self.ended = asyncio.Event()

    def chunk(self, data: bytes) -> None:
        assert not self.errors, "a chunk after the end"
        self.chunks.append(data)

    def end(self, error: BaseException | None) -> None:
        self.errors.append(error)
        self.ended.set()


def sse_event(i: int) -> bytes:
    return b"data: {\"n\": %d}\n\n" % i


def chunk_frame(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


# ---------------------------------------------------------------------------------------- pool bounds

async def test_per_replica_bound_caps_open_connections_and_every_request_gets_its_answer() -> None:
    async def slow_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        while True:
            _, body = await read_request(reader)
            await asyncio.sleep(0.1)
            writer.write(answer(b"answer to " + body))
            await writer.drain()

    async with fake_replica(slow_echo) as replica, h1(max_connections_per_replica=2) as pool:
        results = await asyncio.wait_for(
            asyncio.gather(*(fetch(pool, replica.url, b"request %d" % i) for i in range(5))), 10.0)
        assert results == [(200, b"answer to request %d" % i) for i in range(5)]
        assert replica.max_open == 2  # never more than the bound at once
        assert replica.accepted == 2  # the waiting requests took the pooled connections


async def test_idle_connections_count_toward_max_connections() -> None:
    # a keep-alive far beyond the waits: only the total bound can close A's idle connection
    async with fake_replica(echo) as a, fake_replica(echo) as b, \
            h1(max_connections=1, keepalive_timeout_s=60.0) as pool:
        assert await fetch(pool, a.url, b"to a") == (200, b"to a")
        assert pool._idle == 1  # A's connection waits in the pool
        assert await fetch(pool, b.url, b"to b") == (200, b"to b")
        await asyncio.wait_for(a.done[0].wait(), WAIT_S)  # A saw its idle connection closed
        assert (a.accepted, b.accepted) == (1, 1)
        assert pool._idle + pool._busy == 1


async def test_idle_connection_closes_after_the_keepalive_timeout() -> None:
    async with fake_replica(echo) as replica, h1(keepalive_timeout_s=0.2) as pool:
        assert await fetch(pool, replica.url, b"one") == (200, b"one")
        await asyncio.wait_for(replica.done[0].wait(), 2.0)  # the client closed the idle connection
        assert await fetch(pool, replica.url, b"two") == (200, b"two")
        assert replica.accepted == 2


# ---------------------------------------------------------------------- reuse only after a complete answer

async def test_unsolicited_bytes_on_an_idle_connection_close_it() -> None:
    async def chatty(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        if index > 0:
            return await echo(reader, writer, index)
        _, body = await read_request(reader)
        writer.write(answer(body))
        await writer.drain()
        await asyncio.sleep(0.05)  # the client has the answer; its connection is idle
        writer.write(answer(b"stray"))
        await writer.drain()
        await until_eof(reader)

    async with fake_replica(chatty) as replica, h1() as pool:
        assert await fetch(pool, replica.url, b"one") == (200, b"one")
        await asyncio.wait_for(replica.done[0].wait(), WAIT_S)  # the client closed the desynchronised one
        assert await fetch(pool, replica.url, b"two") == (200, b"two")
        assert replica.accepted == 2


async def test_two_answers_in_one_write_deliver_the_first_and_close_the_connection() -> None:
    async def double(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        if index > 0:
            return await echo(reader, writer, index)
        _, body = await read_request(reader)
        writer.write(answer(body) + answer(b"stray"))
        await writer.drain()
        await until_eof(reader)

    async with fake_replica(double) as replica, h1() as pool:
        assert await fetch(pool, replica.url, b"one") == (200, b"one")
        await asyncio.wait_for(replica.done[0].wait(), WAIT_S)
        assert await fetch(pool, replica.url, b"two") == (200, b"two")
        assert replica.accepted == 2


async def test_partial_stray_head_after_the_answer_in_the_same_write_does_not_leak_into_the_next() -> None:
    """The stray bytes start a head but do not finish it: a reused connection would hand the next request
    the stray status line (500) with the next answer's headers and body."""
    async def stray(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        _, body = await read_request(reader)
        if index == 0:
            writer.write(answer(body) + b"HTTP/1.1 500 Stray\r\nx-stray: ")
        else:
            writer.write(answer(body))
        await writer.drain()
        await echo(reader, writer, index)

    async with fake_replica(stray) as replica, h1() as pool:
        assert await fetch(pool, replica.url, b"one") == (200, b"one")
        assert await fetch(pool, replica.url, b"two") == (200, b"two")
        assert replica.accepted == 2


async def test_early_answer_to_an_unsent_body_is_returned_and_its_connection_not_reused() -> None:
    release = asyncio.Event()

    async def early(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        if index > 0:
            return await echo(reader, writer, index)
        await reader.readuntil(b"\r\n\r\n")  # the head only: the body is never read
        writer.write(answer(b"too large", b"413 Payload Too Large"))
        await writer.drain()
        # neither reads nor closes: a reused connection would never get an answer
        await asyncio.wait_for(release.wait(), 10.0)

    async with fake_replica(early) as replica, h1() as pool:
        try:
            assert await fetch(pool, replica.url, b"x" * 3_000_000) == (413, b"too large")
            assert await fetch(pool, replica.url, b"small") == (200, b"small")
            assert replica.accepted == 2
        finally:
            release.set()


async def test_answer_ending_in_the_read_that_pauses_it_leaves_a_reading_connection() -> None:
    """A pulled body whose last byte takes the buffer over PAUSE_BYTES: the transport is paused in that
    very read and the complete answer's connection goes back to the pool; the next request on it must
    still get its answer."""
    body = b"y" * (PAUSE_BYTES + 1)

    async with fake_replica(head_then_body(body, then=echo)) as replica, h1() as pool:
        response = await send(pool, replica.url, b"big")
        await eventually(lambda: response._ended)  # nothing read: the whole body is buffered
        assert await read_body(response) == body
        assert await fetch(pool, replica.url, b"next") == (200, b"next")
        assert replica.accepted == 1


# ---------------------------------------------------------------------------------------- bounds on the answer

def _many_headers() -> list[bytes]:
    head = b"HTTP/1.1 200 OK\r\n" + b"".join(b"x-h%03d: %s\r\n" % (i, b"v" * 1000) for i in range(100)) + b"\r\n"
    return [head[i:i + 8192] for i in range(0, len(head), 8192)]


def _one_huge_header() -> list[bytes]:
    head = b"HTTP/1.1 200 OK\r\nx-big: " + b"v" * (MAX_HEAD_BYTES + 4096) + b"\r\ncontent-length: 0\r\n\r\n"
    return [head[i:i + 4096] for i in range(0, len(head), 4096)]


@pytest.mark.parametrize("pieces", [_many_headers(), _one_huge_header()], ids=["many-headers", "one-huge-value"])
async def test_response_head_over_the_bound_is_disconnected(pieces: list[bytes]) -> None:
    async def huge(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        for piece in pieces:  # slowly: each piece is its own read
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.002)
        await until_eof(reader)

    async with fake_replica(huge) as replica, h1() as pool:
        with pytest.raises(Disconnected):
            await send(pool, replica.url, b"{}")
        await asyncio.wait_for(replica.done[0].wait(), WAIT_S)  # and the connection is closed


async def test_response_head_under_the_bound_sent_slowly_is_accepted() -> None:
    head = (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n"
            + b"".join(b"x-h%03d: %s\r\n" % (i, b"v" * 1000) for i in range(60)) + b"\r\n")
    assert len(head) < MAX_HEAD_BYTES

    async def big_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        for i in range(0, len(head), 8192):
            writer.write(head[i:i + 8192])
            await writer.drain()
            await asyncio.sleep(0.002)
        writer.write(b"ok")
        await writer.drain()
        await until_eof(reader)

    async with fake_replica(big_head) as replica, h1() as pool:
        response = await send(pool, replica.url, b"{}")
        assert response.status_code == 200 and len(response.headers.raw) == 61
        assert await read_body(response) == b"ok"


async def test_body_in_the_same_write_as_the_head_does_not_count_toward_the_head_bound() -> None:
    body = b"z" * 300_000

    async def one_write(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(answer(body))
        await writer.drain()
        await until_eof(reader)

    async with fake_replica(one_write) as replica, h1() as pool:
        assert await fetch(pool, replica.url, b"{}") == (200, body)


async def test_switching_protocols_is_disconnected() -> None:
    async def upgrade(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n")
        await writer.drain()
        await until_eof(reader)

    async with fake_replica(upgrade) as replica, h1() as pool:
        with pytest.raises(Disconnected):
            await send(pool, replica.url, b"{}")
        await asyncio.wait_for(replica.done[0].wait(), WAIT_S)


@pytest.mark.parametrize("bad", [
    b"HTTP/1.1 2x0 OK\r\ncontent-length: 0\r\n\r\n",
    b"HTTZ/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
    b"garbage\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nbad header line\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n",
], ids=["status-code", "protocol", "garbage", "header-line", "two-framings"])
async def test_malformed_answer_is_disconnected(bad: bytes) -> None:
    async def malformed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(bad)
        await writer.drain()
        await until_eof(reader)

    async with fake_replica(malformed) as replica, h1() as pool:
        with pytest.raises(Disconnected):
            await send(pool, replica.url, b"{}")
        await asyncio.wait_for(replica.done[0].wait(), WAIT_S)


# ---------------------------------------------------------------------------------------- what is sent

@pytest.mark.parametrize("headers", [
    [(b"x-a", b"1\r\nx-b: 2")],
    [(b"x-a", b"1\n")],
    [(b"x-a", b"1\r")],
    [(b"x-a", b"a\0b")],
    [(b"x-\r\na", b"1")],
    [(b"x\na", b"1")],
    [(b"x\0", b"1")],
    [(b"x-ok", b"1"), (b"x-a", b"1\r\n\r\nPOST /smuggled HTTP/1.1")],
    [(b"transfer-encoding ", b"chunked")],
    [(b"x\ta", b"1")],
    [(b"x-ok", b"1"), (b"", b"1")],
], ids=["value-crlf", "value-lf", "value-cr", "value-nul", "name-crlf", "name-lf", "name-nul", "after-a-good-one",
        "name-space", "name-tab", "name-empty"])
async def test_header_with_cr_lf_or_nul_is_refused_before_anything_is_sent(
        headers: list[tuple[bytes, bytes]]) -> None:
    got: list[bytes] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        got.append(await reader.read(65536))

    async with fake_replica(record) as replica, h1() as pool:
        with pytest.raises(Disconnected):
            await send(pool, replica.url, b"{}", headers)
        await asyncio.sleep(0.05)
        assert replica.accepted == 0 and got == []


HEADER_BYTES = st.binary(max_size=6).map(lambda b: b.replace(b"a", b"\r")) | st.sampled_from(
    [b"x-a", b"", b"a b", b"v:1", b"\n", b"\x00", b"host", b"Content-Length"])


@settings(max_examples=400, deadline=None, derandomize=True)
@given(headers=st.lists(st.tuples(HEADER_BYTES, HEADER_BYTES), max_size=5))
def test_the_head_is_refused_exactly_when_one_header_could_split_it(headers: list[tuple[bytes, bytes]]) -> None:
    """`_wire` checks every name and value in two searches over them all; it refuses a head
    exactly when one kept header, on its own, has an empty name, a CR, LF, NUL, colon, space
    or tab in its name or a CR, LF or NUL in its value (and names that one)."""
    kept = [(n, v) for n, v in headers if n.lower() not in FRAMING]
    bad = [n for n, v in kept if not n or any(c in n for c in b"\r\n\0: \t") or any(c in v for c in b"\r\n\0")]
    try:
        head = _wire(b"POST", "/v1/chat/completions", b"127.0.0.1:1", 2, headers)
    except Disconnected as exc:
        assert bad and repr(bad[0]) in str(exc)
    else:
        assert not bad
        assert head.count(b"\r\n") == 4 + len(kept)


async def test_callers_framing_headers_are_dropped() -> None:
    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        _, body = await read_request(reader, replica)
        writer.write(answer(body))
        await writer.drain()
        await until_eof(reader)

    framing = [(b"Host", b"evil.example"), (b"Content-Length", b"999"), (b"Transfer-Encoding", b"chunked"),
               (b"Connection", b"close"), (b"Expect", b"100-continue"), (b"HOST", b"other.example"),
               (b"content-length", b"0"), (b"x-keep", b"kept")]
    async with fake_replica(record) as replica, h1() as pool:
        assert await fetch(pool, replica.url, b"hello", framing) == (200, b"hello")
    head = replica.heads[0]
    assert head.startswith(b"POST /v1/x HTTP/1.1\r\n")
    assert header_values(head, b"host") == [b"127.0.0.1:%d" % replica.port]
    assert header_values(head, b"content-length") == [b"5"]
    for name in (b"transfer-encoding", b"expect", b"connection"):
        assert header_values(head, name) == [], name
    assert header_values(head, b"x-keep") == [b"kept"]


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:1", "http://", "http:///x", "http://:8080", "127.0.0.1:8000",
                                 "http://127.0.0.1:99999"])
async def test_bad_replica_url_is_connect_failed(url: str) -> None:
    async with h1() as pool:
        with pytest.raises(ConnectFailed):
            await asyncio.wait_for(pool.send(url, "/v1/x", b"{}", []), WAIT_S)


# ---------------------------------------------------------------------------------------- the parser, fuzzed

class StubTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.aborted = False
        self.paused = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted

    def close(self) -> None:
        self.aborted = True


def stub_connection() -> tuple[H1Upstream, _Replica, _Connection, StubTransport]:
    """A connection as the pool's ``_connect`` leaves it (counted busy), on a stub transport."""
    upstream = H1Upstream(UpstreamConfig())
    replica = _Replica("127.0.0.1", 9, b"127.0.0.1:9")
    upstream._replicas["http://127.0.0.1:9"] = replica
    conn = _Connection(upstream, replica)
    upstream._busy += 1
    replica.busy += 1
    upstream._counted.add(conn)
    transport = StubTransport()
    conn.connection_made(transport)
    return upstream, replica, conn, transport


def is_pooled(upstream: H1Upstream, replica: _Replica, conn: _Connection, transport: StubTransport) -> bool:
    pooled = list(replica.idle) == [conn] and upstream._idle == 1 and upstream._busy == 0
    return pooled and replica.busy == 0 and not conn.closed and not transport.aborted


def is_closed(upstream: H1Upstream, replica: _Replica, conn: _Connection, transport: StubTransport,
              by_us: bool = True) -> bool:
    """The pool forgot the connection; ``by_us``: the client closed it (else the replica did)."""
    forgotten = not replica.idle and upstream._idle == 0 and upstream._busy == 0 and replica.busy == 0
    return forgotten and conn.closed and transport.aborted == by_us and conn not in upstream._counted


INFORMATIONAL = [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nlink: </a>; rel=preload\r\n\r\n",
                 b"HTTP/1.1 102 Processing\r\n\r\n"]
TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=8)
VALUE = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEF 0123456789-_/;=,.", max_size=20).map(str.strip)


@st.composite
def responses(draw: st.DrawFn, framings: tuple[str, ...] = ("length", "chunked", "close")) -> tuple[bytes, bytes, str]:
    """(the bytes of an answer, its body, its framing)."""
    wire = b"".join(draw(st.lists(st.sampled_from(INFORMATIONAL), max_size=2)))
    framing = draw(st.sampled_from(framings))
    body = draw(st.binary(max_size=3000))
    headers = [(b"x-" + n.encode(), v.encode()) for n, v in draw(st.lists(st.tuples(TOKEN, VALUE), max_size=3))]
    if framing == "length":
        headers.append((draw(st.sampled_from([b"content-length", b"Content-Length"])), b"%d" % len(body)))
    elif framing == "chunked":
        headers.append((draw(st.sampled_from([b"transfer-encoding", b"Transfer-Encoding"])), b"chunked"))
    else:
        headers.append((b"connection", b"close"))
    order = draw(st.permutations(headers))
    wire += b"HTTP/1.1 200 OK\r\n" + b"".join(b"%s: %s\r\n" % h for h in order) + b"\r\n"
    if framing != "chunked":
        return wire + body, body, framing
    sizes = draw(st.lists(st.integers(1, 700), max_size=12))
    pos = 0
    for size in sizes + [len(body)]:
        piece = body[pos:pos + size]
        if not piece:
            break
        pos += len(piece)
        size_hex = draw(st.sampled_from(["%x", "%X"])) % len(piece)
        ext = draw(st.sampled_from(["", ";a=b", ";ext", ';q="x y"', ";a=b;c=d"]))
        wire += b"%s%s\r\n%s\r\n" % (size_hex.encode(), ext.encode(), piece)
    wire += b"0" + draw(st.sampled_from([b"", b";last=1"])) + b"\r\n"
    trailers = draw(st.lists(st.tuples(TOKEN, VALUE), max_size=2))
    wire += b"".join(b"x-t-%s: %s\r\n" % (n.encode(), v.encode()) for n, v in trailers) + b"\r\n"
    return wire, body, framing


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_parser_fuzz_any_split_gives_the_answer_and_the_right_pool_state(data: st.DataObject) -> None:
    wire, body, framing = data.draw(responses(), label="answer")
    second = framing != "close" and data.draw(st.booleans(), label="a second answer appended")
    if second:
        wire += data.draw(responses(("length", "chunked")), label="second answer")[0]
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(wire) - 1)), max_size=20), label="cuts")))
    pieces = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)]) if wire[a:b]]

    async def scenario() -> None:
        upstream, replica, conn, transport = stub_connection()
        head = conn.request(b"POST /v1/x HTTP/1.1\r\nhost: 127.0.0.1:9\r\ncontent-length: 2\r\n\r\n", b"{}")
        assert transport.written
        for piece in pieces:
            if not conn.closed:  # a real transport delivers nothing after an abort
                conn.data_received(piece)
        if framing == "close":
            conn.connection_lost(None)
        assert head.done()
        response = head.result()
        assert response.status_code == 200
        assert b"".join([chunk async for chunk in response.aiter_raw()]) == body
        if framing == "close":
            assert is_closed(upstream, replica, conn, transport, by_us=False)
        elif second:
            assert is_closed(upstream, replica, conn, transport)
        else:
            assert is_pooled(upstream, replica, conn, transport)
        conn._cancel_idle_timer()

    asyncio.run(scenario())


@pytest.mark.parametrize("stray", [b"H", b"HTTP/1.1 500 Stray\r\nx-a: b", b"HTTP/1.1 100 Continue\r\n\r\n"],
                         ids=["one-byte", "partial-head", "informational"])
async def test_stray_bytes_after_the_answer_in_the_same_read_close_the_connection(stray: bytes) -> None:
    upstream, replica, conn, transport = stub_connection()
    head = conn.request(b"POST /v1/x HTTP/1.1\r\nhost: 127.0.0.1:9\r\ncontent-length: 0\r\n\r\n", b"")
    conn.data_received(answer(b"the answer") + stray)
    response = head.result()
    assert await read_body(response) == b"the answer"
    assert is_closed(upstream, replica, conn, transport)
    conn._cancel_idle_timer()


async def test_head_and_a_big_body_in_one_read_are_not_a_head_over_the_bound() -> None:
    upstream, replica, conn, transport = stub_connection()
    head = conn.request(b"POST /v1/x HTTP/1.1\r\nhost: 127.0.0.1:9\r\ncontent-length: 0\r\n\r\n", b"")
    body = b"b" * (MAX_HEAD_BYTES * 2)
    conn.data_received(answer(body))  # a 128 KiB body with a 40-byte head
    assert head.exception() is None
    assert await read_body(head.result()) == body
    assert is_pooled(upstream, replica, conn, transport)
    conn._cancel_idle_timer()


# ---------------------------------------------------------------------------------------- push

async def sse_or_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
    """b"sse": five events with small pauses; anything else is echoed."""
    while True:
        _, body = await read_request(reader)
        if body != b"sse":
            writer.write(answer(body))
            await writer.drain()
            continue
        writer.write(SSE_HEAD)
        for i in range(5):
            writer.write(chunk_frame(sse_event(i)))
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(b"0\r\n\r\n")
        await writer.drain()


async def test_push_after_the_first_pulled_chunk_gets_the_rest_in_order_then_the_end() -> None:
    async with fake_replica(sse_or_echo) as replica, h1() as pool:
        response = await send(pool, replica.url, b"sse")
        chunks = pull(response)
        assert await asyncio.wait_for(anext(chunks), WAIT_S) == sse_event(0)
        sink = Sink()
        response.push(sink)
        await asyncio.wait_for(sink.ended.wait(), WAIT_S)
        assert sink.chunks == [sse_event(i) for i in range(1, 5)]
        assert sink.errors == [None]
        await chunks.aclose()
        await response.aclose()
        assert await fetch(pool, replica.url, b"after") == (200, b"after")
        assert replica.accepted == 1  # a pushed answer read to its end leaves a reusable connection


async def test_push_ends_with_disconnected_when_the_replica_dies_mid_stream() -> None:
    async def dies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + chunk_frame(sse_event(0)))
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(chunk_frame(sse_event(1)))
        await writer.drain()
        await asyncio.sleep(0.02)  # then closes, the answer unfinished

    async with fake_replica(dies) as replica, h1() as pool:
        response = await send(pool, replica.url, b"sse")
        chunks = pull(response)
        assert await asyncio.wait_for(anext(chunks), WAIT_S) == sse_event(0)
        sink = Sink()
        response.push(sink)
        await asyncio.wait_for(sink.ended.wait(), WAIT_S)
        assert b"".join(sink.chunks) == sse_event(1)
        assert len(sink.errors) == 1 and isinstance(sink.errors[0], Disconnected)
        await chunks.aclose()
        await response.aclose()


async def test_unpush_stops_the_sink() -> None:
    gates = [asyncio.Event(), asyncio.Event()]

    async def gated(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + chunk_frame(sse_event(0)))
        await writer.drain()
        for i, gate in enumerate(gates, 1):
            await asyncio.wait_for(gate.wait(), WAIT_S)
            writer.write(chunk_frame(sse_event(i)))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await until_eof(reader)

    async with fake_replica(gated) as replica, h1() as pool:
        response = await send(pool, replica.url, b"sse")
        chunks = pull(response)
        assert await asyncio.wait_for(anext(chunks), WAIT_S) == sse_event(0)
        sink = Sink()
        response.push(sink)
        gates[0].set()
        await eventually(lambda: len(sink.chunks) == 1)
        response.unpush()
        gates[1].set()
        await eventually(lambda: response._ended)  # the rest arrived, and the end
        await asyncio.sleep(0.02)
        assert sink.chunks == [sse_event(1)] and sink.errors == []
        await chunks.aclose()
        await response.aclose()


async def test_push_delivers_the_buffered_chunks_at_once_in_order() -> None:
    gate = asyncio.Event()

    async def burst(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD)
        for i in range(3):
            writer.write(chunk_frame(sse_event(i)))
            await writer.drain()
            await asyncio.sleep(0.01)
        await asyncio.wait_for(gate.wait(), WAIT_S)
        writer.write(chunk_frame(sse_event(3)) + b"0\r\n\r\n")
        await writer.drain()
        await until_eof(reader)

    async with fake_replica(burst) as replica, h1() as pool:
        response = await send(pool, replica.url, b"sse")
        chunks = pull(response)
        assert await asyncio.wait_for(anext(chunks), WAIT_S) == sse_event(0)
        await eventually(lambda: b"".join(response._chunks) == sse_event(1) + sse_event(2))
        sink = Sink()
        response.push(sink)
        assert b"".join(sink.chunks) == sse_event(1) + sse_event(2) and sink.errors == []  # at once
        gate.set()
        await asyncio.wait_for(sink.ended.wait(), WAIT_S)
        assert b"".join(sink.chunks) == b"".join(sse_event(i) for i in range(1, 4))
        assert sink.errors == [None]
        await chunks.aclose()
        await response.aclose()


async def test_push_after_the_end_delivers_everything_and_the_end_at_once() -> None:
    async with fake_replica(sse_or_echo) as replica, h1() as pool:
        response = await send(pool, replica.url, b"sse")
        await eventually(lambda: response._ended)
        sink = Sink()
        response.push(sink)
        assert b"".join(sink.chunks) == b"".join(sse_event(i) for i in range(5))
        assert sink.errors == [None]
        await response.aclose()


# ---------------------------------------------------------------------------------------- pull-mode bound

async def test_pulled_body_buffer_stays_bounded_while_nothing_is_read() -> None:
    body = random.Random(13).randbytes(6 * 1024 * 1024)

    async with fake_replica(head_then_body(body)) as replica, h1() as pool:
        response = await send(pool, replica.url, b"{}")
        seen: list[int] = []
        for _ in range(10):  # ~0.3 s reading nothing
            await asyncio.sleep(0.03)
            seen.append(response._buffered)
        assert max(seen) < PAUSE_BYTES + 512 * 1024, seen
        assert seen[-1] > PAUSE_BYTES, seen  # it did read up to the bound, then paused
        data = await read_body(response)
        assert len(data) == len(body) and data == body


# ---------------------------------------------------------------------------------------- waiting for a slot

def _holding(hold: asyncio.Event, held: asyncio.Event, head_first: bool) -> Handler:
    """Echo; the body b"hold" is answered only once ``hold`` is set (its head at once if ``head_first``)."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        while True:
            _, body = await read_request(reader)
            if body == b"hold":
                held.set()
                if head_first:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n")
                    await writer.drain()
                await asyncio.wait_for(hold.wait(), WAIT_S * 2)
                writer.write(b"hold" if head_first else answer(b"hold"))
            else:
                writer.write(answer(body))
            await writer.drain()
    return handler


async def test_cancelled_waiting_send_leaves_the_pool_usable() -> None:
    hold, held = asyncio.Event(), asyncio.Event()
    async with fake_replica(_holding(hold, held, head_first=False)) as replica, \
            h1(max_connections_per_replica=1) as pool:
        first = asyncio.ensure_future(fetch(pool, replica.url, b"hold"))
        await asyncio.wait_for(held.wait(), WAIT_S)
        waiting = asyncio.ensure_future(fetch(pool, replica.url, b"never"))
        await eventually(lambda: len(pool._waiters) == 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not pool._waiters
        hold.set()
        assert await asyncio.wait_for(first, WAIT_S) == (200, b"hold")
        assert await fetch(pool, replica.url, b"third") == (200, b"third")
        assert replica.accepted == 1


async def test_woken_waiter_cancelled_before_it_runs_passes_its_turn() -> None:
    hold, held = asyncio.Event(), asyncio.Event()
    async with fake_replica(_holding(hold, held, head_first=True)) as replica, \
            h1(max_connections_per_replica=1) as pool:
        response = await send(pool, replica.url, b"hold")
        # the task itself waits in the pool (no wait_for task in between): cancelling it cancels the waiter
        second = asyncio.ensure_future(pool.send(replica.url, "/v1/x", b"second", []))
        await eventually(lambda: len(pool._waiters) == 1)
        third = asyncio.ensure_future(fetch(pool, replica.url, b"third"))
        await eventually(lambda: len(pool._waiters) == 2)
        hold.set()
        async with asyncio.timeout(WAIT_S):  # in this task: no wait_for task woken after the waiter's
            assert b"".join([chunk async for chunk in response.aiter_raw()]) == b"hold"
        # the answer's end woke this task, then (same callback) the first waiter: it has not run yet
        assert len(pool._waiters) == 1 and pool._idle == 1 and not second.done()
        second.cancel()
        assert await asyncio.wait_for(third, WAIT_S) == (200, b"third")
        with pytest.raises(asyncio.CancelledError):
            await second
        assert replica.accepted == 1


async def test_close_while_a_send_waits_makes_it_connect_failed() -> None:
    hold, held = asyncio.Event(), asyncio.Event()
    async with fake_replica(_holding(hold, held, head_first=True)) as replica, \
            h1(max_connections_per_replica=1) as pool:
        response = await send(pool, replica.url, b"hold")
        waiting = asyncio.ensure_future(pool.send(replica.url, "/v1/x", b"waiting", []))
        await eventually(lambda: len(pool._waiters) == 1)
        await pool.close()
        outcome: object = None
        try:
            outcome = (await asyncio.wait_for(asyncio.gather(waiting, return_exceptions=True), WAIT_S))[0]
            assert isinstance(outcome, ConnectFailed), f"the waiting send gave {outcome!r}"
            with pytest.raises(Disconnected):  # the answer being read was cut by close()
                await read_body(response)
        finally:
            if isinstance(outcome, H1Response):
                await outcome.aclose()
            hold.set()


async def answer_in_two_parts(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                              release: asyncio.Event) -> None:
    """A chunked JSON answer "partial": its head and "par" now, the rest once ``release`` is set."""
    writer.write(SSE_HEAD.replace(b"text/event-stream", b"application/json") + chunk_frame(b"par"))
    await release.wait()
    writer.write(chunk_frame(b"tial") + b"0\r\n\r\n")
    await writer.drain()
    await until_eof(reader)


async def test_arrived_takes_a_whole_answer_at_once_and_nothing_before_its_end() -> None:
    """``arrived``: the body of an answer that has ended complete (the proxy then sends it
    without waiting, so without a timer); None while a body is still coming."""
    release = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(answer(b"whole"))  # the head and the body at once
        await read_request(reader)
        await answer_in_two_parts(reader, writer, release)

    async with fake_replica(serve) as replica, h1() as pool:
        whole = await send(pool, replica.url, b"{}")
        await asyncio.sleep(0.05)  # (the body is parsed as it arrives)
        assert whole.arrived() == b"whole"
        assert await read_body(whole) == b""  # taken: nothing is left to pull
        partial = await send(pool, replica.url, b"{}")
        await asyncio.sleep(0.05)
        assert partial.arrived() is None  # still coming
        release.set()
        assert await read_body(partial) == b"partial"


async def test_a_whole_answer_is_offered_to_the_answer_sink_from_the_connections_callback() -> None:
    """The sink gets (status, raw headers, body) as soon as the answer ends complete, before
    ``send`` returns when the body came with the head; what it takes is ``answered``. An
    answer it declines stays for the caller; ``keep`` takes the offer back; a broken
    answer is never offered; a sink that raises leaves the answer to the caller."""
    release = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        for body in (b"taken", b"declined", b"raised"):
            await read_request(reader)
            writer.write(answer(body))
        await read_request(reader)
        await answer_in_two_parts(reader, writer, release)

    offered: list[tuple[int, bytes]] = []

    def sink(take: bool | None) -> Callable[[int, HeadersLike, bytes], bool]:
        def offer(status: int, headers: HeadersLike, body: bytes) -> bool:
            offered.append((status, body))
            assert (b"content-length", b"%d" % len(body)) in headers.raw
            if take is None:
                raise RuntimeError("a bug in the sink")
            return take
        return offer

    async with fake_replica(serve) as replica, h1() as pool:
        taken = await asyncio.wait_for(pool.send(replica.url, "/v1/x", b"{}", [], sink(True)), WAIT_S)
        assert isinstance(taken, H1Response)
        assert offered == [(200, b"taken")] and taken.answered == b"taken"  # before send returned
        assert taken.arrived() is None and await read_body(taken) == b""  # nothing left for the caller
        declined = await asyncio.wait_for(pool.send(replica.url, "/v1/x", b"{}", [], sink(False)), WAIT_S)
        assert isinstance(declined, H1Response) and declined.answered is None
        assert declined.arrived() == b"declined"
        raised = await asyncio.wait_for(pool.send(replica.url, "/v1/x", b"{}", [], sink(None)), WAIT_S)
        assert isinstance(raised, H1Response) and raised.answered is None
        assert await read_body(raised) == b"raised"
        kept = await asyncio.wait_for(pool.send(replica.url, "/v1/x", b"{}", [], sink(True)), WAIT_S)
        assert isinstance(kept, H1Response)
        kept.keep()  # the caller takes it before its end
        release.set()
        assert await read_body(kept) == b"partial" and kept.answered is None
        assert [body for _, body in offered] == [b"taken", b"declined", b"raised"]


async def test_a_broken_answer_is_not_offered_to_the_answer_sink() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf")
        await writer.drain()
        writer.close()

    offered: list[bytes] = []

    def offer(status: int, headers: HeadersLike, body: bytes) -> bool:
        offered.append(body)
        return True

    async with fake_replica(serve) as replica, h1() as pool:
        response = await asyncio.wait_for(pool.send(replica.url, "/v1/x", b"{}", [], offer), WAIT_S)
        assert isinstance(response, H1Response)
        with pytest.raises(Disconnected):
            await read_body(response)
        assert offered == [] and response.answered is None


async def test_a_sink_attached_after_the_write_in_the_same_callback_gets_the_whole_answer() -> None:
    """The callbacks path writes first (``sending_now`` then ``request``) and attaches the
    sink after (``answer_with``): nothing of the answer is read before the caller returns."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        for body in (b"first", b"second"):
            await read_request(reader)
            writer.write(answer(body))

    offered: list[bytes] = []

    def offer(status: int, headers: HeadersLike, body: bytes) -> bool:
        offered.append(body)
        return True

    async with fake_replica(serve) as replica, h1() as pool:
        assert await read_body(await send(pool, replica.url, b"{}")) == b"first"  # (an idle connection now)
        sending = pool.sending_now(replica.url, "/v1/x", b"{}", [])
        assert sending is not None
        conn, wire = sending
        head = conn.request(wire, b"{}")
        response = conn.response
        assert response is not None
        response.answer_with(offer)
        assert await asyncio.wait_for(head, WAIT_S) is response
        await asyncio.sleep(0.05)  # (the body came with the head)
        assert offered == [b"second"] and response.answered == b"second"


@pytest.mark.parametrize(("size", "answered"), [(5_000, True), (3 * 1024 * 1024, False)])
async def test_when_settled_is_told_once_at_the_end_or_when_the_body_outgrows_the_read_bound(
        size: int, answered: bool) -> None:
    """A head that came alone (the body 50 ms later): ``when_settled``'s callback runs once,
    outside the connection's callback, when the answer ended (the sink took it whole), or,
    for a body past ``PAUSE_BYTES``, when reading stopped for want of a reader (not ended:
    a puller takes it from there, and gets all of it)."""
    body = random.Random(size).randbytes(size)

    offered: list[bytes] = []
    settled: list[tuple[bool, bool]] = []

    def offer(status: int, headers: HeadersLike, data: bytes) -> bool:
        offered.append(data)
        return True

    async with fake_replica(head_then_body(body)) as replica, h1() as pool:
        got = await asyncio.wait_for(pool.send(replica.url, "/v1/x", b"{}", [], offer), WAIT_S)
        assert isinstance(got, H1Response) and not got.ended
        response = got
        response.when_settled(lambda: settled.append((response.ended, response.answered is not None)))
        await eventually(lambda: bool(settled))
        await asyncio.sleep(0.05)
        assert settled == [(answered, answered)]
        if answered:
            assert offered == [body]
        else:
            assert offered == [] and not response.ended
            response.keep()
            assert await read_body(response) == body


async def test_when_settled_after_the_read_bound_was_reached_is_told_at_once() -> None:
    """The head and more than ``PAUSE_BYTES`` of body read before the callback is set
    (reading has stopped already): it is told at once, not left waiting for reads that
    will not come; a puller then gets the whole body."""
    body = random.Random(7).randbytes(3 * 1024 * 1024)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(answer(body))  # head and body together
        await writer.drain()
        await until_eof(reader)

    settled: list[bool] = []
    async with fake_replica(serve) as replica, h1() as pool:
        response = await send(pool, replica.url, b"{}")
        await eventually(lambda: response._buffered > PAUSE_BYTES)
        response.when_settled(lambda: settled.append(response.ended))
        await eventually(lambda: bool(settled))
        assert settled == [False]
        assert await read_body(response) == body
