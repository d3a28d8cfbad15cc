"""kvgate's routing on the pass-through below ASGI: what kvgate would add on callbacks alone.

`kvgate bench peers --overhead` can run this as its target ``python-floor-protocol-routed``.
It is ``python-floor-protocol`` (asyncio Protocols on both sides, ``httptools``, no task
per request, the answer written from the upstream connection's callback) with kvgate's own
request work done inside those callbacks by kvgate's own objects, a ``Gateway`` built from
the settings ``kvgate serve`` would use (in-memory index, cache-aware policy):

- before the replica sees the request: the context (``build_context``: parse, check,
  render, hash), the router's snapshot and decision, the load lease, the routed hook
  (the index's prediction), the client's headers filtered for the replica
  (``upstream_headers``);
- after the answer: kvgate's routing headers on it, its usage read (the body, or the SSE
  events as they pass), the lease released, the replica's success, the policy's feedback
  (``Router.completed``), the metrics.

The index's and hooks' coroutines are kvgate's in-process ones: they finish without
waiting, so they run to their end inside the callback (``gateway.eager.finished``,
as the fleet simulator runs them; one that would wait, a remote index, is refused).

The per-request machinery whose cost a product pays even when nothing goes wrong is here
too, as timers and callbacks: the edge's header and body deadlines (408), the total timeout
of a whole answer and the head then stall timeout of a stream (504, the replica's
answer abandoned), admission's bookkeeping (``offer``, ``started``, ``done``,
``observe``; a request admission would hold is answered 503: nothing here can wait), and
the client watch (a client that leaves aborts its replica's connection and releases the
lease). Left out, with no callbacks design here: retries and failover, the connection and
concurrency caps, pipelining. So it is a floor: what kvgate's routing costs once its server and client are
callbacks (``python-floor-protocol`` alone is the same without the routing). Not a
product: it exists only to be measured.

    python -m loadtest.peers.routed_floor --port 31900 --replica http://127.0.0.1:31001 [--replica ...]
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import orjson
import uvloop

from gateway.app import ENDPOINT_PATHS, Gateway, build_gateway
from gateway.bodies import header_map
from gateway.context import build_context
from gateway.eager import finished
from gateway.errors import GatewayError, NoReplicaAvailable
from gateway.relay import UsageSniffer, error_response, upstream_headers, usage_of_body
from gateway.settings import load_settings
from loadtest.peers.protocol_floor import Front, Pool, Request
from loadtest.peers.python_floor import Replicas, floor_parser
from policies.base import Decision, NoRoutableReplica, Outcome, RequestContext
from replicas.admission import Ticket, TicketState
from replicas.load import LoadLease

ENDPOINTS = {path.encode(): endpoint for endpoint, path in ENDPOINT_PATHS.items()}


class Tap:
    """The answer on its way to the client: kvgate's headers added to its head, its usage
    read, and kvgate's bookkeeping when it ends (``done``)."""

    def __init__(self, front: RoutedFront, ctx: RequestContext, decision: Decision, lease: LoadLease,
                 ticket: Ticket | None, started_s: float) -> None:
        self.front, self.ctx, self.decision, self.lease, self.started_s = front, ctx, decision, lease, started_s
        self.ticket = ticket
        self.status = 0
        self.first_byte_s: float | None = None
        self.sniffer: UsageSniffer | None = None  # a chunked (streamed) answer's usage, read as it passes
        self.body: list[bytes] = []
        self.ended = False
        cfg = front.gateway.settings.upstream
        self.stall_s = cfg.stall_timeout_s
        self.last = front.loop.time()  # the last byte from the replica (the stall timer's reference)
        # until the head: the stream's head timeout or the whole answer's total timeout (as Proxy._try)
        self.timer: asyncio.TimerHandle | None = front.loop.call_at(
            self.last + (cfg.head_timeout_s if ctx.stream else cfg.total_timeout_s), self._timed_out)

    def write(self, data: bytes) -> None:
        if self.ended:
            return
        self.last = self.front.loop.time()
        if self.first_byte_s is None:  # the head (protocol_floor's UpstreamConnection writes it first, whole)
            self.first_byte_s = time.perf_counter()
            self.lease.first_byte()
            self.front.gateway.admission.started(self.ticket)
            if self.ctx.stream and self.timer is not None:  # from here a stream's silence is what is timed
                self.timer.cancel()
                self.timer = self.front.loop.call_at(self.last + self.stall_s, self._stalled)
            self.status = int(data[9:12])
            if b"transfer-encoding: chunked" in data:
                self.sniffer = UsageSniffer()
            d = self.decision
            data = b"%sx-kvgate-replica: %s\r\nx-kvgate-route-reason: %s\r\nx-kvgate-expected-cached-tokens: %d\r\n\r\n" % (
                data[:-2], d.replica.encode("latin-1"), d.reason.encode("latin-1"), d.predicted_cached_tokens)
        elif self.sniffer is not None:
            self.sniffer.feed(data)
        else:
            self.body.append(data)
        self.front.write(data)

    def _timed_out(self) -> None:
        """No head in time (a stream's head timeout, a whole answer's total timeout): 504."""
        self.timer = None
        if self.first_byte_s is None:
            self.front.write(b"HTTP/1.1 504 Gateway Timeout\r\ncontent-length: 0\r\n\r\n")
            self.abort(504)
        else:  # a whole answer past its total timeout, mid-body: nothing more can be said to the client
            self.abort(504, close=True)

    def _stalled(self) -> None:
        now = self.front.loop.time()
        if now < self.last + self.stall_s:
            self.timer = self.front.loop.call_at(self.last + self.stall_s, self._stalled)
            return
        self.timer = None
        self.abort(504, close=True)  # (kvgate ends it with an SSE error event; the cost is the same)

    def abort(self, status: int, close: bool = False) -> None:
        """The replica's answer is abandoned, the request ended as ``status``. (Its connection is
        left to finish or fail on its own, its bytes ignored: the product aborts it.)"""
        self.status = status
        self.done(close, ok=False)

    def done(self, close: bool, ok: bool = True) -> None:
        if self.ended:
            return
        self.ended = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        front = self.front
        gw = front.gateway
        front.tap = None
        self.lease.release()
        gw.admission.done(self.ticket)
        ok = ok and self.status != 0 and not close
        if self.sniffer is not None:
            usage = self.sniffer.usage()
        else:
            usage = usage_of_body(b"".join(self.body)) if self.status == 200 else (None, None, None)
        if ok and self.status < 500:
            gw.registry.report_success(self.decision.replica)
        ttft = None if self.first_byte_s is None else self.first_byte_s - self.started_s
        outcome = Outcome(ok=ok and self.status < 400, status=self.status or 502, prompt_tokens=usage[0],
                          cached_tokens=usage[1], completion_tokens=usage[2], ttft_s=ttft)
        if outcome.ok:
            gw.admission.observe(self.decision.replica, self.decision.predicted_cached_tokens,
                                 outcome.cached_tokens, outcome.prompt_tokens)
        gw.metrics.usage(outcome.prompt_tokens, outcome.cached_tokens)
        gw.metrics.timing(ttft, None)
        finished(gw.router.completed(self.ctx, self.decision, outcome))
        gw.metrics.request_done(self.ctx.endpoint, outcome.status, time.perf_counter() - self.started_s)
        front.done(close)


class RoutedFront(Front):
    """``Front`` with kvgate's routing in its ``on_message_complete``."""

    def __init__(self, gateway: Gateway, pools: dict[str, Pool]) -> None:
        super().__init__(Replicas(list(pools.values())))
        self.gateway, self.pools = gateway, pools
        self.loop = asyncio.get_running_loop()
        self.deadline: asyncio.TimerHandle | None = None  # the edge's header or body deadline
        self.tap: Tap | None = None  # the request under way

    # ---------------------------------------------------------------- the edge's deadlines
    def _arm(self, delay_s: float, what: str) -> None:
        self._disarm()
        self.deadline = self.loop.call_later(delay_s, self._expired, what)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expired(self, what: str) -> None:
        self.deadline = None
        body = orjson.dumps({"error": {"message": f"{what} not received in time", "type": "invalid_request_error"}})
        self.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                   b"connection: close\r\n\r\n%s" % (len(body), body))
        self.done(True)

    def connection_lost(self, exc: Exception | None) -> None:
        """The client left: its request's answer is abandoned (the watch), the lease released."""
        self._disarm()
        if self.tap is not None:
            self.tap.abort(499, close=True)

    # ---------------------------------------------------------------- parser events
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(self.gateway.settings.server.header_timeout_s, "request headers")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))  # all of them, as kvgate's server hands them on

    def on_headers_complete(self) -> None:
        self._arm(self.gateway.settings.server.body_timeout_s, "request body")

    def on_message_complete(self) -> None:
        assert self.transport is not None
        self._disarm()
        self.transport.pause_reading()
        gw = self.gateway
        if self.url == b"/health":  # ready once a replica is routable (the bench waits for it)
            ok = any(v.routable for v in gw.registry.views())
            self.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok" if ok
                       else b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
            self.done(False)
            return
        started_s = time.perf_counter()
        endpoint = ENDPOINTS.get(self.url, "chat")
        body = b"".join(self.body)
        headers = header_map(self.headers)
        router = gw.router
        try:
            ctx = build_context(endpoint, body, headers, headers.get("content-type"), gw.settings)
        except GatewayError as exc:
            self._error(exc, endpoint)
            return
        inputs = finished(router.snapshot(ctx))
        try:
            decision = router.decide(ctx, inputs)
        except NoRoutableReplica as exc:
            router.forget(ctx)
            self._error(NoReplicaAvailable(f"no replica can take this request ({exc})"), endpoint)
            return
        lease = gw.registry.lease(decision.replica, decision.predicted_uncached_tokens)
        finished(router.routed(ctx, decision))
        peer = self.transport.get_extra_info("peername")
        out = upstream_headers(self.headers, gw.header_policy, peer[0] if peer else None)
        ticket = gw.admission.offer(decision.replica, decision.predicted_uncached_tokens, ctx.stream)
        tap = self.tap = Tap(self, ctx, decision, lease, ticket, started_s)
        if ticket is not None and ticket.state is TicketState.HELD:  # admission would hold it: no waiting here
            self.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
            tap.abort(503)
            return
        request = Request(self.parser.get_method(), self.url, out, body)
        self.pools[decision.replica].send(tap, request)

    def _error(self, error: GatewayError, endpoint: str) -> None:
        """kvgate's error answer in the API's shape (its body and status)."""
        answer = error_response(error, None, endpoint)
        self.write(b"HTTP/1.1 %d Error\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
            answer.status_code, len(answer.body), bytes(answer.body)))
        self.done(False)


def main(argv: Sequence[str] | None = None) -> None:
    args = floor_parser(__doc__).parse_args(argv)
    # as kvgate bench peers --overhead runs kvgate: probes slowed down (loadtest.peers.overhead.SLOW_PROBES)
    settings = load_settings(None, {"log_level": "warning", "registry": {
        "replicas": list(args.replica), "probe_interval_s": 60, "loads_poll_interval_s": 60}})

    async def serve() -> None:
        gateway = build_gateway(settings)
        await gateway.start()
        pools: dict[str, Pool] = {str(rid): Pool(rid) for rid in gateway.registry.ids()}
        server = await asyncio.get_running_loop().create_server(lambda: RoutedFront(gateway, pools), args.host,
                                                                args.port)
        try:
            async with server:
                await server.serve_forever()
        finally:
            await gateway.close()

    uvloop.run(serve())


if __name__ == "__main__":
    main()
