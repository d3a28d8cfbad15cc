"""Pass-through to a replica, response relay, and failover before the first byte.

For each attempt: ``router.decide`` picks a replica (the first time over the whole
fleet, then over the replicas not tried yet), ``router.routed`` records it, the registry
leases one unit of load, and the **original body bytes** go upstream with the client's
headers minus hop-by-hop ones. The gateway then waits for the replica's response
headers *and its first body chunk* before answering the client, so that everything
that can fail before the first byte (connect error, timeout, 5xx, a replica dying
mid-prefill) is retried on the next replica, invisible to the client:

    attempt fails before the first byte  -> report_failure, release, retry (<= max_retries)
    5xx and no other replica to try      -> the replica's own 5xx is relayed
    all attempts failed (connect/reset)  -> 502 upstream_error; timeouts -> 504
    SSE dies after the first byte        -> `data: {"error": {...}}` then `data: [DONE]`
    JSON body dies after the first byte  -> 502 upstream_error (bodies are buffered)

Streams are relayed chunk by chunk as they arrive (``aiter_raw``: no decoding, no
re-chunking); ``usage`` is sniffed from SSE lines containing ``"usage"`` and parsed once
at the end (``gateway.relay``). Requests go upstream through ``gateway.upstream`` (a lean
HTTP/1.1 keep-alive client), or through the shared ``httpx.AsyncClient`` when a test
injected a transport into it. The load lease is released, and ``policy.on_completed`` called, when the
response ends, fails, or the client disconnects (``RelayResponse`` runs the cleanup in a
``finally`` shielded from cancellation).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from starlette.responses import Response

from gateway.errors import GatewayError, NoReplicaAvailable, UpstreamError, UpstreamTimeout
from gateway.relay import (
    NOT_RELAYED,
    RelayResponse,
    Usage,
    UsageSniffer,
    error_response,
    json_response,
    route_headers,
    sse_error,
    upstream_headers,
    usage_of,
    usage_of_body,
)
from gateway.upstream import ResponseLike, UpstreamPool
from policies.base import Decision, NoRoutableReplica, Outcome, RequestContext
from prefix_index.base import ReplicaId
from replicas.registry import LoadLease

if TYPE_CHECKING:
    from gateway.app import Gateway

__all__ = ["Proxy", "RelayResponse", "UsageSniffer", "error_response", "json_response", "route_headers",
           "sse_error", "upstream_headers", "usage_of"]  # relay's names, re-exported for existing importers

CLIENT_CLOSED = 499  # nginx's code for "client closed request", used in metrics/outcomes only


class Retryable(Exception):
    """An attempt failed before the first byte; ``reason`` labels the retry metric."""

    def __init__(self, reason: str, error: GatewayError) -> None:
        super().__init__(error.message)
        self.reason = reason
        self.error = error


@dataclass(slots=True)
class Attempt:
    """One routed attempt: the decision, its lease, the open upstream response, its timing."""

    ctx: RequestContext
    decision: Decision
    lease: LoadLease
    started_s: float
    response: ResponseLike | None = None
    first_byte_s: float | None = None
    last_byte_s: float | None = None
    sniffer: UsageSniffer | None = None
    complete: bool = False  # the stream reached its end
    stream_error: str | None = None  # the stream broke after the first byte
    closed: bool = False


class Proxy:
    """Sends a parsed request to the fleet with failover; returns the client's Response."""

    def __init__(self, gateway: Gateway, *, lean_upstream: bool = True) -> None:
        """``lean_upstream``: send with the gateway's own HTTP/1.1 pool (production); False
        sends through the shared httpx client (unit tests inject a transport there)."""
        self.gw = gateway
        self.max_retries = gateway.settings.max_retries
        self.first_byte_timeout_s = gateway.settings.first_byte_timeout_s
        self._urls: dict[tuple[str, str], httpx.URL] = {}
        self.reserve_margin = gateway.settings.reserve_margin
        settings = gateway.settings
        self.upstream = (
            UpstreamPool(settings.connect_timeout_s, settings.read_timeout_s) if lean_upstream else None
        )

    def close(self) -> None:
        """Close the kept-alive upstream connections (the httpx client is closed by its owner)."""
        if self.upstream is not None:
            self.upstream.close()

    async def _send(self, replica: str, path: str, body: bytes,
                    headers: list[tuple[bytes, bytes]]) -> ResponseLike:
        if self.upstream is not None:
            return await self.upstream.send(replica, path, body, headers)
        request = httpx.Request("POST", self._url(replica, path), content=body, headers=headers)
        return await self.gw.client.send(request, stream=True)

    async def forward(self, ctx: RequestContext, path: str, body: bytes,
                      headers: list[tuple[bytes, bytes]], started_s: float) -> Response:
        """Route, send, relay; failures come back as OpenAI-shaped error responses."""
        router = self.gw.router
        inputs = await router.snapshot(ctx)
        tried: set[ReplicaId] = set()
        try:
            decision = router.decide(ctx, inputs)
        except NoRoutableReplica as exc:
            return error_response(NoReplicaAvailable(f"no replica can take this request ({exc})"),
                                  route_headers("none", "no-replica"))
        retries = 0
        while True:
            decision, lease = await self._lease(decision, tried)
            tried.add(decision.replica)
            await router.routed(ctx, decision)
            attempt = Attempt(ctx, decision, lease, started_s)
            try:
                may_retry = retries < self.max_retries
                return await self._try(attempt, path, body, headers, frozenset(tried) if may_retry else None)
            except Retryable as exc:
                failure = exc
                await self._failed(attempt, failure)
            except BaseException:  # a bug or a cancellation: still release the load, then re-raise
                await asyncio.shield(self._close(attempt, Outcome(ok=False, status=500)))
                raise
            if retries >= self.max_retries:
                break
            try:
                decision = router.decide(ctx, inputs, frozenset(tried))
            except NoRoutableReplica:
                break
            retries += 1
            self.gw.metrics.retry(failure.reason)
        return error_response(failure.error, route_headers(attempt.decision.replica, attempt.decision.reason))

    async def _lease(self, decision: Decision, tried: set[ReplicaId]) -> tuple[Decision, LoadLease]:
        """Count the request on the chosen replica now.

        With several gateways sharing state, near-ties are settled across them: the replicas
        scoring within ``reserve_margin`` of the pick go to ``registry.reserve`` (pick first),
        which takes the least loaded over every gateway, so gateways seeing the same scores
        do not herd onto one replica. A clear preference (affinity, a long prefix match) is
        never overridden. The decision follows the replica actually reserved."""
        registry = self.gw.registry
        floor = decision.scores.get(decision.replica, 0.0) - self.reserve_margin
        others = sorted((r for r, score in decision.scores.items()
                         if score >= floor and r != decision.replica and r not in tried),
                        key=lambda r: -decision.scores[r])
        if not self.gw.shared_state or not others:
            return decision, registry.lease(decision.replica, decision.predicted_uncached_tokens)
        lease = await registry.reserve([decision.replica, *others], decision.predicted_uncached_tokens)
        if lease.replica != decision.replica:
            decision = dataclasses.replace(decision, replica=lease.replica, reason="reserve")
        return decision, lease

    async def _failed(self, attempt: Attempt, failure: Retryable) -> None:
        self.gw.registry.report_failure(attempt.decision.replica, failure.reason)
        await self._close(attempt, Outcome(ok=False, status=failure.error.status))

    async def _try(self, attempt: Attempt, path: str, body: bytes,
                   headers: list[tuple[bytes, bytes]], tried: frozenset[ReplicaId] | None) -> Response:
        """One attempt; ``tried`` is None on the last one (a 5xx is then relayed as is)."""
        replica = attempt.decision.replica
        try:
            async with asyncio.timeout(self.first_byte_timeout_s):
                response = attempt.response = await self._send(replica, path, body, headers)
                if response.status_code >= 500 and tried is not None and self._has_alternative(tried):
                    raise Retryable(f"status_{response.status_code}", UpstreamError(
                        f"replica {replica} answered {response.status_code}"))
                chunks = response.aiter_raw()
                first = await anext(chunks, b"")
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise Retryable("timeout", UpstreamTimeout(f"replica {replica} timed out before answering")) from exc
        except httpx.ConnectError as exc:
            raise Retryable("connect", UpstreamError(f"cannot connect to replica {replica}")) from exc
        except (httpx.TransportError, httpx.StreamError) as exc:
            raise Retryable("disconnect", UpstreamError(
                f"replica {replica} failed before answering ({type(exc).__name__})")) from exc
        attempt.first_byte_s = time.perf_counter()
        attempt.lease.first_byte()
        if response.status_code < 500:
            self.gw.registry.report_success(replica)
        else:
            self.gw.registry.report_failure(replica, f"status_{response.status_code}")
        out_headers = self._response_headers(attempt)
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            attempt.sniffer = UsageSniffer()
            return RelayResponse(self._relay(attempt, first, chunks), response.status_code, out_headers,
                                 lambda: self._stream_closed(attempt))
        return await self._buffered(attempt, first, chunks, out_headers)

    def _url(self, replica: str, path: str) -> httpx.URL:
        """Parsed upstream URLs, cached (httpx's URL parsing is a visible cost per request)."""
        key = (replica, path)
        url = self._urls.get(key)
        if url is None:
            if len(self._urls) > 4096:
                self._urls.clear()
            url = self._urls[key] = httpx.URL(replica + path)
        return url

    def _has_alternative(self, tried: frozenset[ReplicaId]) -> bool:
        return any(v.routable and v.id not in tried for v in self.gw.registry.views())

    def _response_headers(self, attempt: Attempt) -> list[tuple[bytes, bytes]]:
        """The replica's headers minus hop-by-hop ones, plus the routing headers (raw)."""
        assert attempt.response is not None
        out = [(k, v) for k, v in attempt.response.headers.raw if k.lower() not in NOT_RELAYED]
        decision = attempt.decision
        out += ((b"x-kvgate-replica", decision.replica.encode("latin-1")),
                (b"x-kvgate-route-reason", decision.reason.encode("latin-1")))
        return out

    async def _buffered(self, attempt: Attempt, first: bytes, chunks: AsyncIterator[bytes],
                        headers: list[tuple[bytes, bytes]]) -> Response:
        assert attempt.response is not None
        status = attempt.response.status_code
        parts = [first]
        try:
            async for chunk in chunks:
                parts.append(chunk)
        except (httpx.TransportError, httpx.StreamError) as exc:
            await self._close(attempt, Outcome(ok=False, status=502, ttft_s=self._ttft(attempt)))
            error = UpstreamError(f"replica {attempt.decision.replica} failed mid-response ({type(exc).__name__})")
            return error_response(error, route_headers(attempt.decision.replica, attempt.decision.reason))
        body = b"".join(parts) if len(parts) > 1 else first
        usage: Usage = (None, None, None)
        if status == 200 and not any(k.lower() == b"content-encoding" for k, _ in headers):
            usage = usage_of_body(body)
        attempt.last_byte_s = time.perf_counter()
        await self._close(attempt, self._outcome(attempt, status, usage))
        response = Response(status_code=status)
        response.body = body
        response.raw_headers = [*headers, (b"content-length", b"%d" % len(body))]
        return response

    async def _relay(self, attempt: Attempt, first: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        sniffer = attempt.sniffer
        assert sniffer is not None
        last = first
        yield first
        sniffer.feed(first)
        try:
            async for chunk in chunks:
                yield chunk
                sniffer.feed(chunk)
                last = chunk
        except (httpx.TransportError, httpx.StreamError) as exc:
            attempt.stream_error = f"replica {attempt.decision.replica} failed mid-stream ({type(exc).__name__})"
            yield (b"" if last.endswith(b"\n\n") else b"\n\n") + sse_error(attempt.stream_error)
            return
        finally:
            attempt.last_byte_s = time.perf_counter()
        attempt.complete = True

    async def _stream_closed(self, attempt: Attempt) -> None:
        """End of a relayed stream: complete, broken upstream, or client gone."""
        assert attempt.response is not None and attempt.sniffer is not None
        status = attempt.response.status_code
        if attempt.complete:
            outcome = self._outcome(attempt, status, attempt.sniffer.usage())
        else:
            status = 502 if attempt.stream_error else CLIENT_CLOSED
            outcome = Outcome(ok=False, status=status, ttft_s=self._ttft(attempt))
        await self._close(attempt, outcome)
        self.gw.request_done(attempt.ctx.endpoint, status, attempt.started_s)

    @staticmethod
    def _ttft(attempt: Attempt) -> float | None:
        return None if attempt.first_byte_s is None else attempt.first_byte_s - attempt.started_s

    def _outcome(self, attempt: Attempt, status: int, usage: Usage) -> Outcome:
        prompt, cached, completion = usage
        return Outcome(ok=status < 400, status=status, prompt_tokens=prompt, cached_tokens=cached,
                       completion_tokens=completion, ttft_s=self._ttft(attempt))

    async def _close(self, attempt: Attempt, outcome: Outcome) -> None:
        """Release the load, close the upstream, run the policy's feedback hook (once)."""
        if attempt.closed:
            return
        attempt.closed = True
        attempt.lease.release()
        if attempt.response is not None:
            await attempt.response.aclose()
        metrics = self.gw.metrics
        metrics.usage(outcome.prompt_tokens, outcome.cached_tokens)
        self.gw.hits.record(attempt.decision.replica, outcome.cached_tokens)  # scale-in: recent hits
        itl = None
        if (attempt.sniffer is not None and outcome.completion_tokens and outcome.completion_tokens > 1
                and attempt.first_byte_s is not None and attempt.last_byte_s is not None):
            itl = (attempt.last_byte_s - attempt.first_byte_s) / (outcome.completion_tokens - 1)
        metrics.timing(outcome.ttft_s, itl)
        await self.gw.router.completed(attempt.ctx, attempt.decision, outcome)
