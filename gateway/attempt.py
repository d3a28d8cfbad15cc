"""One request's attempts, as the proxy (``gateway/proxy.py``) keeps them: the routed
``Attempt`` (decision, lease, the open upstream response, its timing), the ``Failure``
that ended one before its first byte, the ``Tries`` so far, and the small rules on
answers (what fails an attempt, what is a stream, the routing headers, the bytes that end
a broken stream)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gateway.errors import GatewayError
from gateway.relay import UsageSniffer, sse_error
from gateway.upstream import HeadersLike, ResponseLike
from policies.base import Decision, RequestContext
from prefix_index.base import ReplicaId
from replicas.admission import Ticket
from replicas.registry import LoadLease

PINNED = "previous-response"  # the decision reason of a request pinned to its previous response's replica
CLIENT_CLOSED = 499  # nginx's code for "client closed request", used in metrics/outcomes only
BLAMED = frozenset({"connect", "disconnect", "head_timeout", "first_byte_timeout", "total_timeout"})


class Failure(Exception):
    """An attempt failed before the first byte. ``kind`` labels it (see the table);
    ``response`` is the replica's answer when it answered (a 5xx, 503, 429), unread."""

    def __init__(self, kind: str, error: GatewayError, response: ResponseLike | None = None) -> None:
        super().__init__(error.message)
        self.kind = kind
        self.error = error
        self.response = response

    @property
    def retryable(self) -> bool:
        return self.kind != "total_timeout"


@dataclass(slots=True)
class Attempt:
    """One routed attempt: the decision, its lease, the open upstream response, its timing."""

    ctx: RequestContext
    decision: Decision
    lease: LoadLease
    started_s: float
    ticket: Ticket | None = None  # its place in prefill admission (None: not gated)
    response: ResponseLike | None = None
    first_byte_s: float | None = None
    last_byte_s: float | None = None
    sniffer: UsageSniffer | None = None
    complete: bool = False  # the stream reached its end
    stream_error: str | None = None  # the stream broke or stalled after the first byte
    closed: bool = False


@dataclass(slots=True)
class Tries:
    """One request's attempts so far: replicas tried, retries, a 5xx awaiting a second opinion."""

    tried: set[ReplicaId] = dataclasses.field(default_factory=set)
    retries: int = 0
    judge: ReplicaId | None = None  # replica whose 5xx waits for another replica's answer
    fingerprint: int | None = None  # of the body, computed at the first 5xx
    holding: bool = False  # the current attempt is a retry holding a slot of the budget


def stream_broke(attempt: Attempt, exc: BaseException, stalled: bool, stall_s: float, boundary: bool) -> bytes:
    """A stream that broke or stalled after its first byte: noted on the attempt; the
    bytes that end it for the client (an SSE error event in the request's API, and
    ``[DONE]`` for OpenAI's)."""
    what = f"stalled for {stall_s:g} s" if stalled else f"failed mid-stream ({exc})"
    attempt.stream_error = f"replica {attempt.decision.replica} {what}"
    return (b"" if boundary else b"\n\n") + sse_error(attempt.stream_error, api=attempt.ctx.endpoint)


def routing_headers(decision: Decision) -> tuple[tuple[bytes, bytes], ...]:
    """The routing headers on every answer: where it went, why, the cache it expected."""
    return ((b"x-kvgate-replica", decision.replica.encode("latin-1")),
            (b"x-kvgate-route-reason", decision.reason.encode("latin-1")),
            (b"x-kvgate-expected-cached-tokens", str(decision.predicted_cached_tokens).encode("latin-1")))


def fails(status: int) -> bool:
    """An answer that fails its attempt (a 5xx, 429): retried or judged, never sent as it is."""
    return status >= 500 or status == 429


def is_sse(headers: HeadersLike) -> bool:
    return headers.get("content-type", "").startswith("text/event-stream")


def stalled(exc: BaseException) -> bool:
    """A body that went silent (as opposed to one that broke)."""
    return isinstance(exc, TimeoutError)
