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
waiting, so they run to their end inside the callback (``loadtest.fleetsim.router.run_sync``,
as the fleet simulator runs them; one that would wait, a remote index, is refused). Left
out, with no callbacks design here: retries and failover, admission, the total timeout,
the edge's deadlines and caps, the client watch, pipelining. So it is a floor: what kvgate's routing costs once its server and client are
callbacks (``python-floor-protocol`` alone is the same without the routing). Not a
product: it exists only to be measured.

    python -m loadtest.peers.routed_floor --port 31900 --replica http://127.0.0.1:31001 [--replica ...]
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import uvloop

from gateway.app import ENDPOINT_PATHS, Gateway, build_gateway
from gateway.bodies import header_map
from gateway.context import build_context
from gateway.errors import GatewayError, NoReplicaAvailable
from gateway.relay import UsageSniffer, error_response, upstream_headers, usage_of_body
from gateway.settings import load_settings
from loadtest.fleetsim.router import run_sync
from loadtest.peers.protocol_floor import Front, Pool, Request
from loadtest.peers.python_floor import Replicas, floor_parser
from policies.base import Decision, NoRoutableReplica, Outcome, RequestContext
from replicas.load import LoadLease

ENDPOINTS = {path.encode(): endpoint for endpoint, path in ENDPOINT_PATHS.items()}


class Tap:
    """The answer on its way to the client: kvgate's headers added to its head, its usage
    read, and kvgate's bookkeeping when it ends (``done``)."""

    def __init__(self, front: RoutedFront, ctx: RequestContext, decision: Decision, lease: LoadLease,
                 started_s: float) -> None:
        self.front, self.ctx, self.decision, self.lease, self.started_s = front, ctx, decision, lease, started_s
        self.status = 0
        self.first_byte_s: float | None = None
        self.sniffer: UsageSniffer | None = None  # a chunked (streamed) answer's usage, read as it passes
        self.body: list[bytes] = []

    def write(self, data: bytes) -> None:
        if self.first_byte_s is None:  # the head (protocol_floor's UpstreamConnection writes it first, whole)
            self.first_byte_s = time.perf_counter()
            self.lease.first_byte()
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

    def done(self, close: bool) -> None:
        front = self.front
        gw = front.gateway
        self.lease.release()
        ok = self.status != 0 and not close
        if self.sniffer is not None:
            usage = self.sniffer.usage()
        else:
            usage = usage_of_body(b"".join(self.body)) if self.status == 200 else (None, None, None)
        if ok and self.status < 500:
            gw.registry.report_success(self.decision.replica)
        ttft = None if self.first_byte_s is None else self.first_byte_s - self.started_s
        outcome = Outcome(ok=ok and self.status < 400, status=self.status or 502, prompt_tokens=usage[0],
                          cached_tokens=usage[1], completion_tokens=usage[2], ttft_s=ttft)
        gw.metrics.usage(outcome.prompt_tokens, outcome.cached_tokens)
        gw.metrics.timing(ttft, None)
        run_sync(gw.router.completed(self.ctx, self.decision, outcome))
        gw.metrics.request_done(self.ctx.endpoint, outcome.status, time.perf_counter() - self.started_s)
        front.done(close)


class RoutedFront(Front):
    """``Front`` with kvgate's routing in its ``on_message_complete``."""

    def __init__(self, gateway: Gateway, pools: dict[str, Pool]) -> None:
        super().__init__(Replicas(list(pools.values())))
        self.gateway, self.pools = gateway, pools

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))  # all of them, as kvgate's server hands them on

    def on_message_complete(self) -> None:
        assert self.transport is not None
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
        inputs = run_sync(router.snapshot(ctx))
        try:
            decision = router.decide(ctx, inputs)
        except NoRoutableReplica as exc:
            router.forget(ctx)
            self._error(NoReplicaAvailable(f"no replica can take this request ({exc})"), endpoint)
            return
        lease = gw.registry.lease(decision.replica, decision.predicted_uncached_tokens)
        run_sync(router.routed(ctx, decision))
        peer = self.transport.get_extra_info("peername")
        out = upstream_headers(self.headers, gw.header_policy, peer[0] if peer else None)
        request = Request(self.parser.get_method(), self.url, out, body)
        self.pools[decision.replica].send(Tap(self, ctx, decision, lease, started_s), request)

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
