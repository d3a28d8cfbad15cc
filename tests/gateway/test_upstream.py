"""The lean upstream client (gateway.upstream) against a tiny HTTP server on 127.0.0.1."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from gateway.upstream import UpstreamPool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return await reader.readexactly(length)


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


async def _read_all(pool: UpstreamPool, url: str, body: bytes) -> tuple[int, bytes, str]:
    response = await pool.send(url, "/v1/chat/completions", body, [(b"content-type", b"application/json")])
    data = b"".join([chunk async for chunk in response.aiter_raw()])
    await response.aclose()
    return response.status_code, data, response.headers.get("Content-Type")


async def test_keepalive_reuses_one_connection() -> None:
    async with server(echo_keepalive) as (url, connections):
        pool = UpstreamPool(5.0, 5.0)
        for i in range(3):
            assert await _read_all(pool, url, b'{"n":%d}' % i) == (200, b'{"n":%d}' % i, "application/json")
        big = b"x" * 3_000_000  # beyond the read high-water mark: pause/resume reading
        assert (await _read_all(pool, url, big))[1] == big
        assert len(connections) == 1
        pool.close()


async def test_chunked_stream_arrives_in_pieces() -> None:
    async def sse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(3):
            event = b"data: %d\n\n" % i
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1.0)

    async with server(sse) as (url, _):
        pool = UpstreamPool(5.0, 5.0)
        response = await pool.send(url, "/x", b"{}", [])
        chunks = [chunk async for chunk in response.aiter_raw()]
        await response.aclose()
        assert b"".join(chunks) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n" and len(chunks) == 3
        pool.close()


async def test_errors_are_httpx_exceptions() -> None:
    async with server(echo_keepalive) as (url, _):
        pass  # closed: nothing listens on that port any more
    with pytest.raises(httpx.ConnectError):
        await UpstreamPool(5.0, 5.0).send(url, "/x", b"{}", [])

    async def dies_mid_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()

    async with server(dies_mid_body) as (url, _):
        response = await UpstreamPool(5.0, 5.0).send(url, "/x", b"{}", [])
        with pytest.raises(httpx.RemoteProtocolError):
            _ = [chunk async for chunk in response.aiter_raw()]
        await response.aclose()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(5.0)

    async with server(silent) as (url, _):
        with pytest.raises(httpx.ReadTimeout):
            await UpstreamPool(5.0, 0.2).send(url, "/x", b"{}", [])


async def test_connection_closed_by_the_replica_is_replaced() -> None:
    async def one_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()  # then closes, though the response said keep-alive

    async with server(one_per_connection) as (url, connections):
        pool = UpstreamPool(5.0, 5.0)
        assert (await _read_all(pool, url, b"a"))[1] == b"a"
        await asyncio.sleep(0.05)
        assert (await _read_all(pool, url, b"b"))[1] == b"b"
        assert len(connections) == 2
        pool.close()
