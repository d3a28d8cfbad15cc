"""The HTTP client of the request path: aiohttp behind a small ``Upstream`` Protocol.

The proxy sends the original body bytes to ``replica + path`` and reads the answer as
raw bytes. Production uses ``gateway.h1_upstream.H1Upstream`` by default
(``upstream.client = "h1"``: asyncio Protocols + httptools, with the push relay) or
``AiohttpUpstream`` (``"aiohttp"``): one ``aiohttp.ClientSession`` per
gateway process, a bounded ``TCPConnector`` (``upstream.max_connections`` in all,
``upstream.max_connections_per_replica`` per replica, idle connections closed after
``upstream.keepalive_timeout_s``, under uvicorn's 5 s, so the gateway never writes into a
connection the replica is closing), no decompression, no headers of its own (no
user-agent, accept, accept-encoding, content-type), raw byte streaming
(``content.readany``). aiohttp reads informational answers (``100 Continue``, ``103
Early Hints``) and skips them, reads close-delimited bodies to the end, and returns a
connection to the pool only after a complete response: an unfinished or cancelled one
closes its connection, so the replica sees the disconnect (SGLang then aborts the
request). ``HttpxUpstream`` adapts an ``httpx.AsyncClient`` (unit tests inject an
``httpx.MockTransport`` there).

Timeouts of the phases (head, first byte, stall, total) are the proxy's own, so both
implementations only bound the TCP connect. Failures come back as one small hierarchy,
whatever the client library:

    UpstreamFailure            the exchange with a replica failed
     +-- ConnectFailed         no connection (refused, unreachable, connect timeout,
     |                         bad URL): nothing reached the replica
     +-- Disconnected          the connection broke, or the answer was malformed
     +-- UpstreamTimedOut      a transport-level timeout (raised by httpx stubs)

Retry bookkeeping (``RetryBudget``, ``PoisonBodies``) is ``gateway.retry``.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import aiohttp
import httpx
from multidict import CIMultiDict
from yarl import URL

from gateway.upstream_config import UpstreamConfig


class UpstreamFailure(Exception):
    """The exchange with a replica failed; the subclass says how."""


class ConnectFailed(UpstreamFailure):
    """No connection to the replica: nothing was sent."""


class Disconnected(UpstreamFailure):
    """The connection broke (reset, closed early) or the response was malformed."""


class UpstreamTimedOut(UpstreamFailure):
    """A transport-level read timeout (only the httpx adapter raises it)."""


class HeadersLike(Protocol):
    @property
    def raw(self) -> list[tuple[bytes, bytes]]: ...

    def get(self, name: str, default: str = "") -> str: ...


class ResponseLike(Protocol):
    """A response whose head has arrived; the body is read with ``aiter_raw``."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> HeadersLike: ...

    def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body chunks as they arrive; raises ``UpstreamFailure`` if the body breaks."""
        ...

    async def aclose(self) -> None:
        """Release the connection (back to the pool only after a complete body)."""
        ...


async def next_chunk(chunks: AsyncIterator[bytes], limit_s: float) -> bytes | None:
    """The next body chunk within ``limit_s`` (TimeoutError otherwise); None at the end."""
    async with asyncio.timeout(limit_s):
        return await anext(chunks, None)


AnswerSink = Callable[[int, "HeadersLike", bytes], bool]
"""Takes a whole answer (status, headers, body) when it ends complete, from the
client's own callback, and says whether it sent it on (``gateway.push_relay.ChunkWriter.answer``)."""


class Upstream(Protocol):
    async def send(self, replica: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]],
                   answer: AnswerSink | None = None) -> ResponseLike:
        """POST ``body`` to ``replica + path``; returns once the final response head arrived.
        ``answer``: offered the whole answer as soon as it has ended complete, before this
        returns when it comes with its head (a client that cannot do so ignores it)."""
        ...

    async def close(self) -> None: ...


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


class _AiohttpResponse:
    __slots__ = ("_response", "headers", "status_code")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status_code = response.status
        self.headers = RawHeaders(list(response.raw_headers))

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        content = self._response.content
        while True:
            try:
                chunk = await content.readany()
            except aiohttp.ClientError as exc:
                raise Disconnected(f"{type(exc).__name__}: {exc}") from exc
            if not chunk:
                return
            yield chunk

    async def aclose(self) -> None:
        response = self._response
        if response.content.is_eof() and not response.closed:
            response.release()
        else:
            response.close()


class AiohttpUpstream:
    """The production client (see the module docstring); the session is made on first use,
    inside the running event loop."""

    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[tuple[str, str], URL] = {}

    def _make_session(self) -> aiohttp.ClientSession:
        c = self.config
        connector = aiohttp.TCPConnector(
            limit=c.max_connections, limit_per_host=c.max_connections_per_replica,
            keepalive_timeout=c.keepalive_timeout_s, enable_cleanup_closed=True, ttl_dns_cache=10)
        timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=c.connect_timeout_s, sock_read=None)
        return aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False, trust_env=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            raise_for_status=False, cookie_jar=aiohttp.DummyCookieJar())

    def _url(self, replica: str, path: str) -> URL:
        """Parsed upstream URLs, cached (URL parsing is a visible cost per request)."""
        key = (replica, path)
        url = self._urls.get(key)
        if url is None:
            if len(self._urls) > 4096:
                self._urls.clear()
            url = self._urls[key] = URL(replica + path)
        return url

    async def send(self, replica: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]],
                   answer: AnswerSink | None = None) -> ResponseLike:
        session = self._session
        if session is None:
            session = self._session = self._make_session()
        # a CIMultiDict as aiohttp keeps it (repeated names kept in order): it is not converted again
        pairs = CIMultiDict([(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers])
        try:
            response = await session.post(self._url(replica, path), data=body, headers=pairs,
                                          allow_redirects=False, compress=None, chunked=None)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError, aiohttp.InvalidURL) as exc:
            raise ConnectFailed(f"cannot connect to {replica}: {exc}") from exc
        except (aiohttp.ClientError, ValueError) as exc:
            raise Disconnected(f"{type(exc).__name__}: {exc}") from exc
        return _AiohttpResponse(response)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class _HttpxResponse:
    __slots__ = ("_response", "headers", "status_code")

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status_code = response.status_code
        self.headers = RawHeaders(list(response.headers.raw))

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.TimeoutException as exc:
            raise UpstreamTimedOut(str(exc)) from exc
        except (httpx.TransportError, httpx.StreamError) as exc:
            raise Disconnected(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpxUpstream:
    """``Upstream`` over an ``httpx.AsyncClient`` (tests inject ``httpx.MockTransport``)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def send(self, replica: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]],
                   answer: AnswerSink | None = None) -> ResponseLike:
        try:
            request = httpx.Request("POST", replica + path, content=body, headers=headers)
            return _HttpxResponse(await self.client.send(request, stream=True))
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
            raise ConnectFailed(f"cannot connect to {replica}: {exc}") from exc
        except httpx.TimeoutException as exc:
            raise UpstreamTimedOut(str(exc)) from exc
        except (httpx.TransportError, httpx.StreamError) as exc:
            raise Disconnected(f"{type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        """The client belongs to the gateway, which closes it."""
