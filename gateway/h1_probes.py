"""Probes and load polls over kvgate's own HTTP/1.1 client (``upstream.client = "h1"``).

``H1Getter`` is a ``replicas.probe.Getter`` on a pool of its own (an ``H1Upstream``, at
most ``per_replica`` connections to one replica), so a probe never waits behind the
request path's connections nor takes one of theirs. The gateway GETs every replica's
``/v1/loads`` every second and its ``/ready`` every two: with aiohttp that was ~2.8% of
kvgate's CPU samples in ``kvgate bench peers`` (8 replicas, issue 15's profile,
docs/profile.md). The same bounds as ``AiohttpGetter``: the connection (pool wait
included) and the head within the timeout, every body read within it, the whole GET
within ``PROBE_TOTAL_FACTOR`` of it, the body within ``MAX_PROBE_BODY_BYTES``; a refused,
broken or malformed answer is ``ProbeFailed``, no answer in time ``ProbeTimedOut``.
``https://`` replicas go through an ``AiohttpGetter`` (TLS is not this client's).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

from gateway.h1_upstream import H1Upstream
from gateway.upstream import UpstreamFailure, next_chunk
from gateway.upstream_config import UpstreamConfig
from replicas.probe import (
    PROBE_TOTAL_FACTOR,
    AiohttpGetter,
    ProbeFailed,
    ProbeTimedOut,
    bounded_body,
)


class H1Getter:
    def __init__(self, per_replica: int = 4) -> None:
        self._per_replica = per_replica
        self._upstream = H1Upstream(UpstreamConfig(max_connections_per_replica=per_replica))
        self._tls: AiohttpGetter | None = None

    async def __call__(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        try:
            parts = urlsplit(url)
        except ValueError as e:
            raise ProbeFailed(f"bad URL {url!r}: {e}") from e
        if parts.scheme != "http":
            if self._tls is None:
                self._tls = AiohttpGetter(self._per_replica)
            return await self._tls(url, timeout_s)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            async with asyncio.timeout(PROBE_TOTAL_FACTOR * timeout_s):
                async with asyncio.timeout(timeout_s):
                    response = await self._upstream.get(f"http://{parts.netloc}", path)
                try:
                    return response.status_code, await bounded_body(_each_within(response.aiter_raw(), timeout_s))
                finally:
                    await response.aclose()  # (an answer read to its end is back in the pool already)
        except TimeoutError as e:
            raise ProbeTimedOut(f"no answer within {timeout_s:g} s") from e
        except UpstreamFailure as e:
            raise ProbeFailed(f"{type(e).__name__}: {e}") from e

    async def close(self) -> None:
        await self._upstream.close()
        if self._tls is not None:
            await self._tls.close()


async def _each_within(chunks: AsyncIterator[bytes], timeout_s: float) -> AsyncIterator[bytes]:
    """The chunks, each read within ``timeout_s``."""
    while (chunk := await next_chunk(chunks, timeout_s)) is not None:
        yield chunk
