"""The callbacks path: a small request for a whole answer, routed and sent from the
client connection's own callback, with no task unless something has to wait.

Issue 15's measurements (docs/profile.md, "What would close the small-body gap"): kvgate's
routing work costs about the same on any base, but its base, a task per request and the
ASGI layers above it, adds ~0.15 ms to a small request against the same work done inside
the connections' callbacks. So a request that can be served without waiting is served
there:

- ``EdgeProtocol`` (gateway/edge.py) holds an inference ``POST`` to one of ``urls``
  (``HeldCycle``: no ASGI task, scope or cycle yet) until its body is complete (a body
  over ``gateway.edge.DEFER_MAX_BYTES`` starts its task then; an ``Expect: 100-continue``
  or a request pipelined behind another is not held), then offers it to
  ``CallbackPath.take`` from ``on_message_complete``. Its task, when it needs one, gets
  uvicorn's scope and cycle then, with the extensions ``start_task`` is given.
- ``take`` parses it (``build_context``), reads the in-process index (``snapshot``) and
  decides (``Router.choose``), all without side effects, and keeps the request only when
  nothing in it has to wait: not a stream, not the Responses API (its store waits), the
  index and hooks in process, no state shared with other gateways, the concurrency cap
  not reached, not shutting down. Else it returns False having done nothing, and the
  request goes the task path from its start (which answers every refusal and error, so
  those are written in one place).
- Kept, ``Proxy.lease_now`` counts the decision, leases the load and runs the hooks in
  the same callback, as the task path does right after its decision (the next decision
  sees this one: no herding). With an idle upstream connection to the decided replica
  (``H1Upstream.sending_now``), ``Proxy.begin`` writes the request on it first and then
  routes it (the replica starts on the request while the gateway does that bookkeeping;
  nothing can come back, and no other request be decided, before the callback returns);
  the whole answer is written to the client from the upstream connection's callback by
  the proxy's answer sink, as on the task path, and its bookkeeping runs there too
  (``Proxy.answered``). With none, the request goes to its task leased and routed, and
  the task sends it (one parse, one decision a request).
- A whole answer whose body comes after its head (uvicorn-served replicas, SGLang among
  them, write the two apart, and the gateway often reads the head alone) stays here until
  its end (``H1Response.when_settled``), and the sink writes it then.
- Anything else hands the request to its task, with the attempt as it stands
  (``Proxy.resume``): an answer that fails the attempt (a 5xx, 429 or 503: retried or
  judged there), a stream, a body past ``PAUSE_BYTES`` (only a puller reads on), or a
  failure before the answer's end (a broken connection, the total timeout). From there it is the task
  path's request: failover, the retry budget, the client watch, the shutdown cut.
- While on callbacks, a request keeps the bounds of the task path: the total timeout
  (``upstream.total_timeout_s``: the connection is closed and the task answers 504), the
  client leaving (the upstream connection is closed, SGLang aborts; counted 499), the
  concurrency cap (it counts in ``Edge.active``) and the shutdown (waited for like a task,
  and cut at the end of the grace with a 503).

``server.callback_path`` turns it off (every request then goes the task path).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from gateway.app import ENDPOINT_PATHS
from gateway.bodies import header_map
from gateway.context import build_context
from gateway.eager import WouldWait, finished
from gateway.errors import GatewayError
from gateway.h1_upstream import H1Response, H1Upstream
from gateway.proxy import CLIENT_CLOSED, Begun, Failure, sent_whole
from gateway.relay import upstream_headers
from gateway.server import RESUME_EXTENSION, edge_error
from policies.base import NoRoutableReplica

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.edge import Edge, HeldCycle, StartTask
    from gateway.push_relay import ChunkWriter

log = logging.getLogger("kvgate.callbacks")
CUT_MESSAGE = "the gateway shut down before the response was complete; retry"


def hand_over(begun: Begun, start_task: StartTask) -> None:
    """The request goes on in its ASGI task, from ``begun`` (``Gateway.handle``)."""
    start_task({RESUME_EXTENSION: begun})


class CallbackPath:
    """One gateway process's callbacks path: which requests it takes, and those in flight."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.endpoints = {path: endpoint for endpoint, path in ENDPOINT_PATHS.items() if endpoint != "responses"}
        self.urls = frozenset(path.encode("ascii") for path in self.endpoints)  # held by the edge (``take``)
        self.flights: set[Flight] = set()  # taken, not yet answered or handed to a task

    @classmethod
    def of(cls, gateway: Gateway) -> CallbackPath | None:
        """The gateway's callbacks path, or None when its requests always have something
        to wait on (a Redis index, state shared with other gateways, an upstream client that
        cannot send without waiting) or ``server.callback_path`` is off. (Precise mode's
        lookup does not wait: it is a call into the in-process event index.)"""
        usable = (gateway.settings.server.callback_path and isinstance(gateway.proxy.upstream, H1Upstream)
                  and not gateway.index.concurrent_reads and not gateway.shared_state)
        return cls(gateway) if usable else None

    def take(self, edge: Edge, held: HeldCycle, writer: ChunkWriter, start_task: StartTask) -> bool:
        """Route and send the request (a ``POST`` to one of ``urls``, its body complete) now;
        False, with nothing done, when it must go the task path from its start.
        ``start_task`` starts its ASGI task: for a request decided here that cannot be sent
        without waiting, and for a hand-over (``Flight``): the task goes on from there (one
        parse, one decision a request)."""
        endpoint = self.endpoints.get(held.path)
        if (endpoint is None or edge.closing or edge.active >= edge.config.max_concurrent_requests
                or (edge.admin_port is not None and (held.server or ("", None))[1] == edge.admin_port)):
            return False  # (the task path refuses or answers these)
        started_s = time.perf_counter()
        gw = self.gateway
        ctx = decision = None
        body = held.body
        raw_headers = held.headers
        try:
            if len(body) > gw.settings.hashing.max_body_bytes:
                return False
            headers = header_map(raw_headers)
            ctx = build_context(endpoint, body, headers, headers.get("content-type"), gw.settings)
            if ctx.stream:
                return False
            router = gw.router
            inputs = finished(router.snapshot(ctx))
            decision = router.choose(ctx, inputs)
            peer = held.client
            out_headers = upstream_headers(raw_headers, gw.header_policy, peer[0] if peer else None, held.scheme)
            upstream = gw.proxy.upstream
            assert isinstance(upstream, H1Upstream)
            path = ENDPOINT_PATHS[endpoint]
            conn = upstream.sending_now(decision.replica, path, body, out_headers)
        except (GatewayError, NoRoutableReplica, WouldWait):
            decision = None  # the task path answers it (or waits)
        except Exception:  # a bug: the task path runs into it too, and answers 500 in the API's shape
            log.exception("callbacks path: request %s left to its task", held.path)
            decision = None
        if decision is None:  # nothing done: the task path from the start
            if ctx is not None:
                gw.router.forget(ctx)  # (its precise lookup, if any: the task path looks again)
            return False
        assert ctx is not None
        # from here the request is this path's: leased and routed in this callback, as the
        # task path does right after its decision (the next decision sees this one); it ends
        # answered here, handed to its task, or cut
        if conn is None:  # sending would wait (no idle connection): the task sends it
            hand_over(Begun(gw.proxy.lease_now(ctx, decision, started_s), inputs, path, body, out_headers), start_task)
            return True
        begun = gw.proxy.begin(ctx, decision, started_s, conn, body, writer)  # sent, then routed
        if begun is None:  # the write failed, nothing routed: the task path from the start
            gw.router.forget(ctx)
            return False
        attempt, head = begun
        flight = Flight(self, edge, held.path, writer, Begun(attempt, inputs, path, body, out_headers, sent=True),
                        start_task)
        try:
            flight.start(head)
        except Exception:  # a bug: the attempt goes on in its task (its failover, its error answers)
            log.exception("callbacks path: request %s handed to its task", ctx.request_id)
            flight.fail()
        return True


class Flight:
    """One request on the callbacks path, from its write upstream to its answer or hand-over."""

    __slots__ = ("attempt", "begun", "callbacks", "counted", "edge", "ended", "head", "path", "start_task",
                 "timed_out", "timer", "writer")

    def __init__(self, callbacks: CallbackPath, edge: Edge, path: str, writer: ChunkWriter, begun: Begun,
                 start_task: StartTask) -> None:
        self.callbacks, self.edge, self.path, self.writer = callbacks, edge, path, writer
        self.begun, self.attempt, self.start_task = begun, begun.attempt, start_task
        self.head: asyncio.Future[H1Response] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timed_out = False
        self.ended = False
        self.counted = False  # in ``Edge.active`` and the flights

    def start(self, head: asyncio.Future[H1Response]) -> None:
        self.head = head
        self.edge.active += 1
        self.callbacks.flights.add(self)
        self.counted = True
        cfg = self.callbacks.gateway.proxy.cfg
        left_s = cfg.total_timeout_s - (time.perf_counter() - self.attempt.started_s)
        self.timer = asyncio.get_running_loop().call_later(max(left_s, 0.0), self._expired)
        head.add_done_callback(self._headed)
        if not self.writer.watch(self._lost):
            self._lost()  # gone already

    def _end(self, outcome: str) -> bool:
        """Leave the callbacks path (once): timer, watch and counts; False when it had left."""
        if self.ended:
            return False
        self.ended = True
        self.callbacks.gateway.metrics.callback_outcomes[outcome].inc()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.writer.watch(None)
        if self.counted:
            self.counted = False
            self.edge.active -= 1
            self.callbacks.flights.discard(self)
        return True

    def _abort_upstream(self) -> None:
        response = self.attempt.response
        if isinstance(response, H1Response):
            response.close()

    def _headed(self, head: asyncio.Future[H1Response]) -> None:
        """The answer's head came (or the exchange failed before it). A whole answer whose
        body is still coming (a replica writes the head and the body apart, and they may
        arrive in two reads) stays here: the sink sends it at its end, then ``_settled``."""
        if self.ended:
            return
        try:
            exc = asyncio.CancelledError() if head.cancelled() else head.exception()
            if exc is not None:
                self._hand_over(self.callbacks.gateway.proxy.begun_failure(self.attempt, None if self.timed_out else exc))
                return
            response = head.result()
            if response.answered is None and not response.ended and sent_whole(response.status_code,
                                                                              response.headers):
                response.when_settled(self._settled)
                return
        except Exception:  # a bug here must not leave the request hanging
            log.exception("callbacks path failed for request %s", self.attempt.ctx.request_id)
            self.fail()
            return
        self._settled()

    def _settled(self) -> None:
        """The answer ended (the sink sent it, or could not), or it needs a reader: answered
        here, or handed to the task (which takes the answer where it stands)."""
        if self.ended:
            return
        try:
            proxy = self.callbacks.gateway.proxy
            response = self.attempt.response
            assert isinstance(response, H1Response)
            if response.answered is not None:  # the sink wrote the whole answer
                self._end("answered")
                proxy.answered(self.attempt)
            elif self.timed_out:  # the body did not come in time: a total timeout, as on the task path
                self._hand_over(proxy.begun_failure(self.attempt, None))
            else:
                self._hand_over(None)
        except Exception:  # a bug here must not leave the request hanging
            log.exception("callbacks path failed for request %s", self.attempt.ctx.request_id)
            self.fail()

    def fail(self) -> None:
        """A bug on this path: the upstream request closed, the attempt handed to the task
        as failed (its failover or its error answer)."""
        self._abort_upstream()
        self._hand_over(self.callbacks.gateway.proxy.begun_failure(
            self.attempt, RuntimeError("internal error on the callbacks path")))

    def _hand_over(self, failure: Failure | None) -> None:
        """The request goes on in its task (``Proxy.resume``), where its attempt stands."""
        if not self._end("handed_over"):
            return
        self.begun.failure = failure
        hand_over(self.begun, self.start_task)

    def _expired(self) -> None:
        """``upstream.total_timeout_s`` passed without the whole answer: the upstream request
        is closed, and the task answers as its total timeout does (504, or failover)."""
        self.timer = None
        head, response = self.head, self.attempt.response
        if self.ended or head is None or (head.done() and isinstance(response, H1Response) and response.ended):
            return  # (the answer is in: its callback decides)
        self.timed_out = True
        self._abort_upstream()

    def _lost(self) -> None:
        """The client left before its answer: the upstream request is closed (SGLang aborts it)."""
        if not self._end("client_left"):
            return
        self._abort_upstream()
        log.info("client left before the answer of request %s", self.attempt.ctx.request_id)
        self.callbacks.gateway.proxy.abandon(self.attempt, CLIENT_CLOSED)

    def cut(self) -> None:
        """The shutdown grace is over: a 503 for the client, the upstream request closed."""
        if not self._end("cut"):
            return
        self._abort_upstream()
        body = edge_error(self.path, 503, CUT_MESSAGE, "server_shutdown", "server_shutdown")
        try:
            self.writer.answer(503, [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                     (b"content-length", b"%d" % len(body))], body)
        except RuntimeError as exc:
            log.info("could not end a cut request: %s", exc)
        self.callbacks.gateway.proxy.abandon(self.attempt, 503)
