"""Pass-through to a replica: outcome classification, retries, relay, cancellation.

For each attempt the router picks a replica (first over the whole fleet, then over the
routable replicas not tried yet), the registry leases one unit of load, and the
**original body bytes** go upstream (``gateway.upstream``) with the client's headers
cleaned (``relay.upstream_headers``). Nothing reaches the client before the replica's
first body byte, so whatever fails before it can be retried invisibly. Every outcome:

    outcome                                       retry                      against the replica
    ------------------------------------------------------------------------------------------------
    before the first byte
    connect refused / reset / closed before head  elsewhere                  failure
    stream: no head in head_timeout_s (10 s)      elsewhere                  failure
    stream: no first chunk in first_byte_timeout  elsewhere (attempt closed) failure
    503 / 429 (overloaded, queue full)            elsewhere                  none
    other 5xx                                     once, on one other replica (a second opinion):
      ... the other answers < 400                 -                          failure (the first)
      ... the other answers 5xx too               no: its 5xx is relayed     none (the request's own:
                                                                             its body is remembered as
                                                                             poison, copies get no retry)
    5xx of a poison body, or unjudged 5xx         no: relayed as is          none
    non-stream: no answer in total_timeout_s      never resent (accepted:    failure; 504
                                                  a slow generation)
    4xx                                           no: relayed as is          success
    after the first byte
    stream: silent for stall_timeout_s (60 s)     no: SSE error + [DONE]     failure
    stream breaks                                 no: SSE error + [DONE]     failure
    non-stream body breaks                        no: 502                    failure
    client leaves (any time, also before the      upstream request closed    none; status 499
    head or while a body is buffered)             (SGLang aborts it)
    give up (max_retries, retry budget, no        the last replica's answer as is, else
    replica left)                                 502 upstream_error / 504 upstream_timeout

A request pinned to one replica (``forward(..., pin=)``: a Responses request whose
``previous_response_id`` that replica created, ``gateway.api_routes``) is decided with
every other replica excluded (reason ``previous-response``), never goes through
``reserve`` and is never retried elsewhere: its failure is answered as it is. Error
bodies and the SSE error event are in the shape of the request's API (``ctx.endpoint``).

"failure" feeds the registry's outlier detector (replicas/outlier.py), one per distinct
request; "success" resets its streak. Retries are bounded per request (``max_retries``)
and fleet-wide (``RetryBudget``: retries in flight <= max(``retry_budget_min``,
``retry_budget_ratio`` x requests in flight)); beyond the budget the first error goes
back to the client. A refused connection spends no budget: nothing was sent, so its retry
adds no work anywhere (the budget bounds the extra work retries make), and a replica
that dies under load must not fail the requests that were about to reach it.

Streams are relayed as the replica's bytes arrive: one ASGI send per read, no decoding,
no re-chunking, one stall timer per stream (``gateway.stall_watch``); ``usage`` is found
by a byte search for the key and parsed once at the end (``gateway.relay.UsageSniffer``).
Several gateways agree: a Redis index in write-behind mode records a turn after its
request was sent upstream, so before any byte that can end a response reaches the client
(a buffered answer; a stream's bytes after its first read, or a first read that already
holds the stream's end) the proxy awaits the index's ``published``: this gateway's queued
writes have reached Redis, at most ``index.redis_visible_wait_s`` (a longer wait counts
in ``kvgate_index_degraded_total``). So the client cannot send its next turn, through
any gateway, before that gateway can see this one. Other first bytes are not held.

The load lease is released, ``policy.on_completed`` called and a stream that ended well
fed to its replica's learned speed (``replicas.speed``) when the response ends, fails, or
the client leaves (``RelayResponse``: in a ``finally`` shielded from cancellation). A
buffered answer (``AnsweredResponse``) does its part of this right after its body is handed to
the client's transport, so the client does not wait for it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from starlette.responses import Response

from gateway import access_log
from gateway.admission import Admission, AdmissionConfig
from gateway.attempt import (
    BLAMED,
    CLIENT_CLOSED,
    PINNED,
    Attempt,
    Failure,
    Tries,
    fails,
    is_sse,
    routing_headers,
    stalled,
    stream_broke,
)
from gateway.errors import NoReplicaAvailable, UpstreamError, UpstreamTimeout
from gateway.metrics import GatewayMetrics
from gateway.relay import (
    AnsweredResponse,
    RelayResponse,
    Usage,
    UsageSniffer,
    downstream_headers,
    error_response,
    route_headers,
    usage_of_body,
)
from gateway.retry import PoisonBodies, RetryBudget
from gateway.router import Router
from gateway.scaling import HitWindow
from gateway.stall_watch import StallWatch
from gateway.upstream import ConnectFailed, Upstream, UpstreamFailure, next_chunk
from gateway.upstream_config import UpstreamConfig
from policies.base import Decision, NoRoutableReplica, Outcome, RequestContext, RoutingInputs
from prefix_index.base import ReplicaId
from replicas.registry import LoadLease, Registry

__all__ = ["CLIENT_CLOSED", "PINNED", "Proxy"]

log = logging.getLogger("kvgate.proxy")

STREAM_ENDS = (b"data: [DONE]", b"event: message_stop", b"event: response.completed")
"""The last event of a chat / completions, Messages and Responses stream: a first read
holding one is the whole answer, held until the index's writes are published."""


class Proxy:
    """Sends a parsed request to the fleet with failover; returns the client's Response."""

    def __init__(self, cfg: UpstreamConfig, upstream: Upstream, router: Router, registry: Registry,
                 metrics: GatewayMetrics, hits: HitWindow, *, shared_state: bool,
                 admission: Admission | None = None) -> None:
        """``shared_state``: several gateways share replica state (near-ties go to ``reserve``).
        ``admission``: prefill admission (``gateway.admission``; default: off)."""
        self.admission = admission or Admission(AdmissionConfig(enabled=False))
        self.upstream = upstream
        self.router = router
        self.registry = registry
        self.metrics = metrics
        self.hits = hits
        self.shared_state = shared_state
        self.cfg = cfg
        self.budget = RetryBudget(cfg.retry_budget_ratio, cfg.retry_budget_min)
        self.poison = PoisonBodies(cfg.poison_ttl_s, cfg.poison_max_entries, time.monotonic)
        # a remote index's write barrier (Redis write-behind); embedded indexes write in place
        self.published: Callable[[], Awaitable[bool]] | None = getattr(router.index, "published", None)

    async def close(self) -> None:
        await self.upstream.close()

    async def forward(self, ctx: RequestContext, path: str, body: bytes,
                      headers: list[tuple[bytes, bytes]], started_s: float,
                      pin: ReplicaId | None = None) -> Response:
        """Route, send, relay; failures come back as error responses in the shape of the
        request's API (``ctx.endpoint``). ``pin``: the only replica that may take it (the
        creator of a ``previous_response_id``): the policy decides with every other replica
        excluded, the decision's reason becomes ``previous-response``, nothing is retried
        elsewhere."""
        router = self.router
        inputs = await router.snapshot(ctx)
        try:
            if pin is None:
                decision = router.decide(ctx, inputs)
            else:
                others = frozenset(v.id for v in inputs.replicas if v.id != pin)
                decision = dataclasses.replace(router.decide(ctx, inputs, others), reason=PINNED)
        except NoRoutableReplica as exc:
            router.forget(ctx)  # never routed: nothing will complete it
            return error_response(NoReplicaAvailable(f"no replica can take this request ({exc})"),
                                  route_headers("none", "no-replica"), ctx.endpoint)
        self.budget.requests += 1
        return await self._counted(self._attempts(ctx, inputs, decision, path, body, headers, started_s))

    async def _counted(self, attempts: Coroutine[Any, Any, Response]) -> Response:
        """``attempts``' response; the request leaves the budget's count of requests when it
        is answered (a stream: when it ends, ``_stream_closed``)."""
        response: Response | None = None
        try:
            response = await attempts
            return response
        finally:
            if not isinstance(response, RelayResponse):
                self.budget.requests -= 1

    async def _attempts(self, ctx: RequestContext, inputs: RoutingInputs, decision: Decision, path: str,
                        body: bytes, headers: list[tuple[bytes, bytes]], started_s: float) -> Response:
        tries = Tries()
        try:
            while True:
                decision, lease = await self._lease(decision, tries.tried)
                tries.tried.add(decision.replica)
                await self.router.routed(ctx, decision)
                attempt = self._attempt(ctx, decision, lease, started_s)
                try:
                    await self.admission.wait(attempt.ticket)
                    response = await self._try(attempt, path, body, headers)
                except Failure as exc:
                    failure = exc
                except BaseException:  # a cancellation (client gone) or a bug: release the load, re-raise
                    await asyncio.shield(self._close(attempt, Outcome(ok=False, status=CLIENT_CLOSED)))
                    raise
                else:
                    self._judged(tries, response.status_code)
                    return response
                finally:
                    self._release_retry(tries)
                next_decision = self._after_failure(ctx, inputs, tries, attempt, failure, body)
                if next_decision is None:
                    return await self._give_up(attempt, failure)
                await self._discard(attempt, failure)
                tries.retries += 1
                self.metrics.retry(failure.kind)
                decision = next_decision
        finally:
            self._release_retry(tries)

    def _release_retry(self, tries: Tries) -> None:
        if tries.holding:
            self.budget.release()
            tries.holding = False

    def _after_failure(self, ctx: RequestContext, inputs: RoutingInputs, tries: Tries, attempt: Attempt,
                       failure: Failure, body: bytes) -> Decision | None:
        """Blame (or not) the replica; the next decision, or None to give up."""
        replica = attempt.decision.replica
        if failure.kind == "status_5xx":
            if tries.judge is not None:  # a second replica's 5xx: the request's own
                self.poison.add(self._fingerprint(tries, body))
                log.info("request %s: 5xx from %s and %s; relayed, no replica blamed", ctx.request_id,
                         tries.judge, replica)
                tries.judge = None
                return None
            if self._fingerprint(tries, body) in self.poison:
                return None
        elif failure.kind in BLAMED:
            self.registry.report_failure(replica, failure.kind)
        if not failure.retryable or tries.retries >= self.cfg.max_retries or attempt.decision.reason == PINNED:
            return None  # (no other replica holds a pinned request's previous response)
        decision = self._retry_decision(ctx, inputs, tries, budgeted=failure.kind != "connect")
        if decision is not None and failure.kind == "status_5xx":
            tries.judge = replica
        return decision

    def _retry_decision(self, ctx: RequestContext, inputs: RoutingInputs, tries: Tries,
                        budgeted: bool) -> Decision | None:
        """The policy's next choice over routable replicas not tried yet, within the budget
        when ``budgeted`` (a refused connection's retry is not)."""
        exclude = tries.tried | {v.id for v in self.registry.views() if not v.routable}
        if all(v.id in exclude for v in inputs.replicas):
            return None
        if budgeted and not self.budget.try_acquire():
            self.metrics.retry_budget_spent()
            return None
        try:
            decision = self.router.decide(ctx, inputs, frozenset(exclude))
        except NoRoutableReplica:
            if budgeted:
                self.budget.release()
            return None
        tries.holding = budgeted
        return decision

    def _judged(self, tries: Tries, status: int) -> None:
        """Another replica answered after a 5xx: below 400 the first replica was to blame."""
        if tries.judge is not None and status < 400:
            self.registry.report_failure(tries.judge, "status_5xx")
        tries.judge = None

    @staticmethod
    def _fingerprint(tries: Tries, body: bytes) -> int:
        if tries.fingerprint is None:
            tries.fingerprint = PoisonBodies.fingerprint(body)
        return tries.fingerprint

    async def _discard(self, attempt: Attempt, failure: Failure) -> None:
        await self._close(attempt, Outcome(ok=False, status=failure.error.status))

    async def _give_up(self, attempt: Attempt, failure: Failure) -> Response:
        """No more attempts: the replica's own answer as it is, else the gateway's error."""
        if failure.response is not None:
            return await self._buffered(attempt, b"", failure.response.aiter_raw(), self._response_headers(attempt))
        await self._close(attempt, Outcome(ok=False, status=failure.error.status))
        return error_response(failure.error, route_headers(attempt.decision.replica, attempt.decision.reason),
                              attempt.ctx.endpoint)

    async def _lease(self, decision: Decision, tried: set[ReplicaId]) -> tuple[Decision, LoadLease]:
        """Count the request on the chosen replica now.

        With several gateways sharing state, near-ties are settled across them: the replicas
        scoring within ``reserve_margin`` of the pick go to ``registry.reserve`` (pick first),
        which takes the least loaded over every gateway, so gateways seeing the same scores
        do not herd onto one replica. A clear preference (affinity, a long prefix match) is
        never overridden. The decision follows the replica actually reserved."""
        registry = self.registry
        others: list[ReplicaId] = []
        if self.shared_state and decision.reason != PINNED:  # (else no near-ties to settle: no sort of the scores)
            floor = decision.scores.get(decision.replica, 0.0) - self.cfg.reserve_margin
            others = sorted((r for r, score in decision.scores.items()
                             if score >= floor and r != decision.replica and r not in tried),
                            key=lambda r: -decision.scores[r])
        if not others:
            return decision, registry.lease(decision.replica, decision.predicted_uncached_tokens)
        lease = await registry.reserve([decision.replica, *others], decision.predicted_uncached_tokens)
        if lease.replica != decision.replica:
            decision = dataclasses.replace(decision, replica=lease.replica, reason="reserve")
        return decision, lease

    async def _try(self, attempt: Attempt, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> Response:
        """One attempt up to its first body byte (raises ``Failure``), then the relay."""
        replica = attempt.decision.replica
        stream = attempt.ctx.stream
        cfg = self.cfg
        try:
            async with asyncio.timeout(cfg.head_timeout_s if stream else cfg.total_timeout_s):
                response = attempt.response = await self.upstream.send(replica, path, body, headers)
        except (TimeoutError, UpstreamFailure) as exc:
            raise self._failure(exc, "head_timeout" if stream else "total_timeout", replica) from exc
        status = response.status_code
        if fails(status):
            kind = f"status_{status}" if status in (429, 503) else "status_5xx"
            raise Failure(kind, UpstreamError(f"replica {replica} answered {status}"), response)
        chunks = response.aiter_raw()
        wait_s = cfg.first_byte_timeout_s if stream else cfg.total_timeout_s - (time.perf_counter() - attempt.started_s)
        try:
            async with asyncio.timeout(max(wait_s, 0.0)):
                first = await anext(chunks, b"")
        except (TimeoutError, UpstreamFailure) as exc:
            raise self._failure(exc, "first_byte_timeout" if stream else "total_timeout", replica) from exc
        self._first_byte(attempt)
        out_headers = self._response_headers(attempt)
        if is_sse(response.headers):
            attempt.sniffer = UsageSniffer()
            return RelayResponse(self._relay(attempt, first, chunks), status, out_headers,
                                 lambda: self._stream_closed(attempt))
        return await self._buffered(attempt, first, chunks, out_headers)

    def _attempt(self, ctx: RequestContext, decision: Decision, lease: LoadLease, started_s: float) -> Attempt:
        """A leased and routed attempt, with its place in prefill admission."""
        return Attempt(ctx, decision, lease, started_s,
                       self.admission.offer(decision.replica, lease.predicted_uncached_tokens, ctx.stream,
                                            self.registry.memory_bound(decision.replica)))

    def _first_byte(self, attempt: Attempt) -> None:
        attempt.first_byte_s = time.perf_counter()
        attempt.lease.first_byte()
        self.admission.started(attempt.ticket)

    def _failure(self, exc: BaseException, timeout_kind: str, replica: str) -> Failure:
        """An attempt's failure before its answer: a timeout (``timeout_kind``), a refused or a
        broken connection (the table above), anything else as a broken one."""
        if isinstance(exc, TimeoutError):
            return Failure(timeout_kind, UpstreamTimeout(f"replica {replica} timed out before answering "
                                                         f"({timeout_kind})"))
        if isinstance(exc, ConnectFailed):
            return Failure("connect", UpstreamError(f"cannot connect to replica {replica}"))
        return Failure("disconnect", UpstreamError(f"replica {replica} failed before answering ({exc})"))

    @staticmethod
    def _response_headers(attempt: Attempt) -> list[tuple[bytes, bytes]]:
        """The replica's headers, cleaned, plus the routing headers (raw)."""
        assert attempt.response is not None
        return [*downstream_headers(attempt.response.headers.raw), *routing_headers(attempt.decision)]

    async def _buffered(self, attempt: Attempt, first: bytes, chunks: AsyncIterator[bytes],
                        headers: list[tuple[bytes, bytes]]) -> Response:
        parts = [first]
        try:
            while (chunk := await next_chunk(chunks, self.cfg.read_timeout_s)) is not None:
                parts.append(chunk)
        except (TimeoutError, UpstreamFailure) as exc:
            what = "stalled" if stalled(exc) else f"broke ({exc})"
            return await self._broken_body(attempt, f"replica {attempt.decision.replica} {what} mid-response")
        if self.published is not None:
            await self.published()
        return self._answer(attempt, b"".join(parts) if len(parts) > 1 else first, headers)

    def _answer(self, attempt: Attempt, body: bytes, headers: list[tuple[bytes, bytes]]) -> AnsweredResponse:
        """The whole answer, for the client; its bookkeeping runs once it is sent."""
        assert attempt.response is not None
        status = attempt.response.status_code
        attempt.last_byte_s = time.perf_counter()
        return AnsweredResponse(body, status, headers, lambda: self._sent(attempt, body, headers))

    async def _sent(self, attempt: Attempt, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        """A buffered answer handed to the client (or failed to be): its usage, outcome,
        feedback and metrics (``AnsweredResponse`` runs this after the write)."""
        assert attempt.response is not None
        status = attempt.response.status_code
        usage: Usage = (None, None, None)
        if status == 200 and not any(k.lower() == b"content-encoding" for k, _ in headers):
            usage = usage_of_body(body)
        if status < 500:
            self.registry.report_success(attempt.decision.replica)
        await self._close(attempt, self._outcome(attempt, status, usage))
        self.metrics.request_done(attempt.ctx.endpoint, status, time.perf_counter() - attempt.started_s,
                                  attempt.ctx.model)

    async def _broken_body(self, attempt: Attempt, message: str) -> Response:
        self.registry.report_failure(attempt.decision.replica, "mid_body")
        await self._close(attempt, Outcome(ok=False, status=502, ttft_s=self._ttft(attempt)))
        return error_response(UpstreamError(message), route_headers(attempt.decision.replica,
                                                                    attempt.decision.reason),
                              attempt.ctx.endpoint)

    async def _relay(self, attempt: Attempt, first: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The stream's bytes as they arrive, one chunk per read; a break or a stall ends it
        with an SSE error event (``_stream_broke``)."""
        sniffer = attempt.sniffer
        assert sniffer is not None
        stall_s = self.cfg.stall_timeout_s
        last = first
        published = self.published
        if published is not None and any(end in first for end in STREAM_ENDS):
            await published()  # the first read is the whole answer
            published = None
        yield first
        sniffer.feed(first)
        watch = StallWatch(stall_s)  # one timer for the stream, not one per chunk
        try:
            while True:
                watch.reading()
                chunk = await anext(chunks, None)
                watch.arrived()
                if chunk is None:
                    break
                if published is not None:  # once: the writes queued so far reach Redis first
                    await published()
                    published = None
                yield chunk
                sniffer.feed(chunk)
                last = chunk
        except (asyncio.CancelledError, TimeoutError, UpstreamFailure) as exc:
            silent = watch.stalled(exc)  # this watch's own cancellation, taken back
            if isinstance(exc, asyncio.CancelledError) and not silent:
                raise
            yield stream_broke(attempt, exc, silent or stalled(exc), stall_s, last.endswith(b"\n\n"))
            return
        finally:
            watch.close()
            attempt.last_byte_s = time.perf_counter()
        attempt.complete = True

    async def _stream_closed(self, attempt: Attempt) -> None:
        """End of a relayed stream: complete, broken upstream, or client gone."""
        assert attempt.response is not None and attempt.sniffer is not None
        self.budget.requests -= 1
        status = attempt.response.status_code
        replica = attempt.decision.replica
        if attempt.complete:
            self.registry.report_success(replica)
            outcome = self._outcome(attempt, status, attempt.sniffer.usage())
        else:
            status = 502 if attempt.stream_error else CLIENT_CLOSED
            if attempt.stream_error:
                self.registry.report_failure(replica, "mid_stream")
            outcome = Outcome(ok=False, status=status, ttft_s=self._ttft(attempt))
        await self._close(attempt, outcome)
        self.metrics.request_done(attempt.ctx.endpoint, status, time.perf_counter() - attempt.started_s,
                                  attempt.ctx.model)

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
        self.admission.done(attempt.ticket)
        if outcome.ok:
            self.admission.observe(attempt.decision.replica, attempt.decision.predicted_cached_tokens,
                                   outcome.cached_tokens, outcome.prompt_tokens)
        if attempt.response is not None:
            await attempt.response.aclose()
        self.metrics.usage(outcome.prompt_tokens, outcome.cached_tokens)
        self.hits.record(attempt.decision.replica, outcome.cached_tokens)  # scale-in: recent hits
        itl = stream_s = None
        if (attempt.sniffer is not None and outcome.completion_tokens and outcome.completion_tokens > 1
                and attempt.first_byte_s is not None and attempt.last_byte_s is not None):
            itl = (stream_s := attempt.last_byte_s - attempt.first_byte_s) / (outcome.completion_tokens - 1)
        self.metrics.timing(outcome.ttft_s, itl, attempt.ctx.model)
        if outcome.ok and stream_s is not None:
            self.registry.observe_speed(attempt.decision.replica, outcome.prompt_tokens, outcome.cached_tokens,
                                        outcome.ttft_s, outcome.completion_tokens, stream_s)
        access_log.record(attempt.ctx, attempt.decision, outcome)
        await self.router.completed(attempt.ctx, attempt.decision, outcome)
