"""The request path's clients (gateway.upstream.AiohttpUpstream, gateway.h1_upstream.H1Upstream) against a
tiny HTTP server on 127.0.0.1: one contract, every test run against both."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from gateway.h1_upstream import H1Upstream
from gateway.upstream import AiohttpUpstream, ConnectFailed, Disconnected, Upstream
from gateway.upstream_config import UpstreamConfig

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_head(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return head, await reader.readexactly(length)


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    return (await _read_head(reader))[1]


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """Yields (base URL, connection count)."""
    connections: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            await handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", connections
    finally:
        srv.close()
        await asyncio.wait_for(srv.wait_closed(), 5.0)


async def echo_keepalive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        body = await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(body), body))
        await writer.drain()


async def _read_all(pool: Upstream, url: str, body: bytes) -> tuple[int, bytes, str]:
    response = await pool.send(url, "/v1/chat/completions", body, [(b"content-type", b"application/json")])
    data = b"".join([chunk async for chunk in response.aiter_raw()])
    await response.aclose()
    return response.status_code, data, response.headers.get("Content-Type")


MakeClient = Callable[[], Upstream]
CLIENTS: dict[str, type[AiohttpUpstream | H1Upstream]] = {"aiohttp": AiohttpUpstream, "h1": H1Upstream}


@pytest.fixture(params=sorted(CLIENTS))
def client(request: pytest.FixtureRequest) -> MakeClient:
    kind = CLIENTS[request.param]
    return lambda: kind(UpstreamConfig(connect_timeout_s=5.0))


async def test_keepalive_reuses_one_connection(client: MakeClient) -> None:
    async with server(echo_keepalive) as (url, connections):
        pool = client()
        for i in range(3):
            assert await _read_all(pool, url, b'{"n":%d}' % i) == (200, b'{"n":%d}' % i, "application/json")
        big = b"x" * 3_000_000
        assert (await _read_all(pool, url, big))[1] == big
        assert len(connections) == 1
        await pool.close()


async def test_chunked_stream_arrives_in_pieces(client: MakeClient) -> None:
    async def sse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(3):
            event = b"data: %d\n\n" % i
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1.0)

    async with server(sse) as (url, _):
        pool = client()
        response = await pool.send(url, "/x", b"{}", [])
        chunks = [chunk async for chunk in response.aiter_raw()]
        await response.aclose()
        assert b"".join(chunks) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n" and len(chunks) == 3
        await pool.close()


async def test_informational_answers_are_skipped_and_never_leak(client: MakeClient) -> None:
    """100 Continue and 103 Early Hints before each answer: every request gets its own."""
    async def hints(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            body = await _read_request(reader)
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>; rel=preload\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    async with server(hints) as (url, connections):
        pool = client()
        for i in range(5):
            assert (await _read_all(pool, url, b"request %d" % i))[:2] == (200, b"request %d" % i)
        assert len(connections) == 1
        await pool.close()


async def test_close_delimited_body_is_read_to_the_end(client: MakeClient) -> None:
    async def close_delimited(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n")
        for part in (b'{"a": ', b'"' + b"x" * 100_000 + b'"', b"}"):
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.01)

    async with server(close_delimited) as (url, connections):
        pool = client()
        for _ in range(2):
            status, data, _ = await _read_all(pool, url, b"{}")
            assert status == 200 and data == b'{"a": "' + b"x" * 100_000 + b'"}'
        assert len(connections) == 2  # a close-delimited answer is never pooled
        await pool.close()


async def test_no_headers_of_its_own(client: MakeClient) -> None:
    seen: list[bytes] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await _read_head(reader)
        seen.append(head.lower())
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()

    async with server(record) as (url, _):
        pool = client()
        response = await pool.send(url, "/x", b"{}", [(b"x-custom", b"1")])
        await response.aclose()
        await pool.close()
    names = {line.split(b":")[0] for line in seen[0].split(b"\r\n")[1:] if line}
    assert names == {b"host", b"content-length", b"x-custom"}


async def test_failures_are_classified(client: MakeClient) -> None:
    async with server(echo_keepalive) as (url, _):
        pass  # closed: nothing listens on that port any more
    pool = client()
    with pytest.raises(ConnectFailed):
        await pool.send(url, "/x", b"{}", [])

    async def dies_mid_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()

    async with server(dies_mid_body) as (url, _):
        response = await pool.send(url, "/x", b"{}", [])
        with pytest.raises(Disconnected):
            _ = [chunk async for chunk in response.aiter_raw()]
        await response.aclose()

    async def closes_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)

    async with server(closes_at_once) as (url, _):
        with pytest.raises(Disconnected):
            await pool.send(url, "/x", b"{}", [])
    await pool.close()


async def test_cancelled_request_closes_its_connection(client: MakeClient) -> None:
    gone = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        if await reader.read(1) == b"":
            gone.set()

    async with server(slow) as (url, _):
        pool = client()
        task = asyncio.ensure_future(pool.send(url, "/x", b"{}", []))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(gone.wait(), 5.0)  # the replica saw the disconnect
        await pool.close()


async def test_connection_closed_by_the_replica_is_replaced(client: MakeClient) -> None:
    async def one_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()  # then closes, though the response said keep-alive

    async with server(one_per_connection) as (url, connections):
        pool = client()
        assert (await _read_all(pool, url, b"a"))[1] == b"a"
        await asyncio.sleep(0.05)
        assert (await _read_all(pool, url, b"b"))[1] == b"b"
        assert len(connections) == 2
        await pool.close()


async def test_the_replica_urls_own_path_comes_first(client: MakeClient) -> None:
    seen: list[bytes] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await _read_head(reader)
        seen.append(head.split(b"\r\n")[0])
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()

    async with server(record) as (url, _):
        pool = client()
        response = await pool.send(url + "/base", "/v1/x", b"{}", [])
        await response.aclose()
        await pool.close()
    assert seen == [b"POST /base/v1/x HTTP/1.1"]
