"""The HTTP client of the request path: aiohttp behind a small ``Upstream`` Protocol.

The proxy sends the original body bytes to ``replica + path`` and reads the answer as
raw bytes through ``AiohttpUpstream``, for ``http://`` and ``https://`` replicas alike:
one ``aiohttp.ClientSession`` per gateway process, a bounded ``TCPConnector``
(``upstream.max_connections`` requests in flight in all, ``upstream.max_connections_per_replica``
per replica: a request beyond either waits for a connection; idle connections closed after
``upstream.keepalive_timeout_s``, under uvicorn's 5 s, so the gateway never writes into a
connection the replica is closing), ``https://`` replicas verified as ``replica_ssl`` says
(``upstream.tls_ca_file``, ``upstream.tls_verify``), no decompression, no headers of its
own (no user-agent, accept, accept-encoding, content-type) and the caller's framing
headers replaced by its own (``FRAMING``), raw byte streaming (``content.readany``).
aiohttp skips informational answers (``100 Continue``, ``103 Early Hints``; a ``101`` is
``Disconnected``), reads close-delimited bodies to the end, and returns a connection to the
pool only after a complete response: an unfinished or cancelled one closes its connection,
so the replica sees the disconnect (SGLang then aborts the request).
``tests/gateway/test_upstream.py`` holds the contract against fake replicas; two limits of
aiohttp 3.14 are marked there as expected failures (an answer a replica sends on an idle
pooled connection is given to the next request on it; an early answer, a 413 before the
replica read the body, returns its half-written connection to the pool): only a replica
that breaks HTTP/1.1 meets them.

Timeouts of the phases (head, first byte, stall, total) are the proxy's own, so the client
only bounds the TCP connect. Failures come back as one small hierarchy:

    UpstreamFailure            the exchange with a replica failed
     +-- ConnectFailed         no connection (refused, unreachable, connect timeout, TLS
     |                         handshake or certificate, bad URL): nothing reached the replica
     +-- Disconnected          the connection broke, or the answer was malformed

Retry bookkeeping (``RetryBudget``, ``PoisonBodies``) is ``gateway.retry``.
"""
from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from typing import Protocol

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from gateway.upstream_config import UpstreamConfig


class UpstreamFailure(Exception):
    """The exchange with a replica failed; the subclass says how."""


class ConnectFailed(UpstreamFailure):
    """No connection to the replica: nothing was sent."""


class Disconnected(UpstreamFailure):
    """The connection broke (reset, closed early) or the response was malformed."""


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


class Upstream(Protocol):
    async def send(self, replica: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> ResponseLike:
        """POST ``body`` to ``replica + path``; returns once the final response head arrived."""
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


FRAMING = frozenset({b"host", b"content-length", b"transfer-encoding", b"connection", b"expect"})
"""Request headers of the client's own: the caller's are dropped (``Expect: 100-continue``
would hold the body back, a second length would split the request)."""


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


def replica_ssl(config: UpstreamConfig) -> ssl.SSLContext | bool:
    """How ``https://`` replicas' certificates are verified, as aiohttp's ``ssl=`` takes it:
    ``True`` (the system trust store), a context that trusts only the CAs of
    ``upstream.tls_ca_file`` (and checks the host name or IP), or ``False``
    (``upstream.tls_verify = false``: any certificate). For the request path and the probes."""
    if not config.tls_verify:
        return False
    if config.tls_ca_file is None:
        return True
    return ssl.create_default_context(cafile=str(config.tls_ca_file))


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
            keepalive_timeout=c.keepalive_timeout_s, enable_cleanup_closed=True, ttl_dns_cache=10,
            ssl=replica_ssl(c))
        timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=c.connect_timeout_s, sock_read=None)
        return aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False, trust_env=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            raise_for_status=False, cookie_jar=aiohttp.DummyCookieJar())

    def _url(self, replica: str, path: str) -> URL:
        """Parsed upstream URLs, cached (URL parsing is a visible cost per request);
        ``ConnectFailed`` for a URL that names no http(s) host and port."""
        key = (replica, path)
        url = self._urls.get(key)
        if url is None:
            try:
                url = URL(replica + path)
                valid = url.scheme in ("http", "https") and bool(url.host) and url.port is not None
            except ValueError as exc:
                raise ConnectFailed(f"bad replica URL {replica!r}: {exc}") from exc
            if not valid:
                raise ConnectFailed(f"bad replica URL {replica!r}")
            if len(self._urls) > 4096:
                self._urls.clear()
            self._urls[key] = url
        return url

    async def send(self, replica: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> ResponseLike:
        session = self._session
        if session is None:
            session = self._session = self._make_session()
        url = self._url(replica, path)
        # a CIMultiDict as aiohttp keeps it (repeated names kept in order): it is not converted
        # again; the framing is the client's own (FRAMING: the caller's would contradict it)
        pairs = CIMultiDict([(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers
                             if k.lower() not in FRAMING])
        try:
            response = await session.post(url, data=body, headers=pairs,
                                          allow_redirects=False, compress=None, chunked=None)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError, aiohttp.InvalidURL,
                aiohttp.NonHttpUrlClientError) as exc:
            raise ConnectFailed(f"cannot connect to {replica}: {exc}") from exc
        except (aiohttp.ClientError, ValueError) as exc:
            raise Disconnected(f"{type(exc).__name__}: {exc}") from exc
        if response.status < 200:  # 101 Switching Protocols: no HTTP answer follows
            response.close()
            raise Disconnected(f"{response.status} {response.reason} from {replica}")
        return _AiohttpResponse(response)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
