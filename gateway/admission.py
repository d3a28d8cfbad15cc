"""The proxy's side of prefill admission (``replicas.admission``): tickets and waits.

``Admission.offer`` turns a routed attempt into a ticket (streaming requests only; a
non-streaming one gets ``None`` and is never held: its first byte is the end of the whole
generation, so the gateway cannot see its prefill end). ``wait`` returns when the ticket
is released: at once (also when the replica's recent predictions were far off:
``replicas.admission.PredictionTrust``), when the replica's prefill ahead drops below the budget (smallest
first, or the oldest once later arrivals overtook it by ``bypass_factor`` x its size), when the
ticket reaches ``max_wait_s`` (the age bound: delayed, never starved), or when the
replica leaves routing (``flush``). A client that leaves while held cancels the wait and
``done`` takes the ticket out. ``started`` (the attempt's first byte) and ``done`` (its
end, in every path) are idempotent, so the proxy calls them where it already moves the
load lease.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pydantic import BaseModel, Field

from prefix_index.base import ReplicaId
from replicas.admission import AdmissionFront, PredictionTrust, Ticket, TicketState
from replicas.model import ReplicaState, ReplicaView


class AdmissionConfig(BaseModel):
    """Hold streaming requests per replica and release them shortest prefill first."""

    enabled: bool = Field(default=True, description="off: every request is sent at once, first come first served")
    budget_tokens: int = Field(
        default=8192, ge=1,
        description="released, unstarted predicted prefill per replica above which new requests are held "
        "(~ one chunked-prefill step of a large GPU)")
    max_wait_s: float = Field(default=30.0, ge=0, description="a request held this long is released anyway")
    bypass_factor: float = Field(
        default=0.5, ge=0,
        description="a held request is overtaken by later arrivals for at most this times the prefill it would "
        "wait for first come, first served (0: first come, first served; replicas.admission)")
    trust_window: int = Field(default=64, ge=1, description="a replica's last predictions that decide whether "
                              "its order is trusted (replicas.admission.PredictionTrust)")
    trust_min_close: float = Field(
        default=0.9, ge=0, le=1,
        description="below this share of close predictions a replica is served first come, first served")
    trust_tolerance_tokens: int = Field(
        default=256, ge=0, description="a prediction is close within this many tokens (or trust_tolerance_share "
        "of the prompt, whichever is larger)")
    trust_tolerance_share: float = Field(default=0.0, ge=0, le=1, description="see trust_tolerance_tokens")

    def trust(self) -> PredictionTrust:
        return PredictionTrust(window=self.trust_window, min_samples=min(16, self.trust_window),
                               min_close=self.trust_min_close, tolerance_tokens=self.trust_tolerance_tokens,
                               tolerance_share=self.trust_tolerance_share)


class Admission(AdmissionFront):
    """Futures over one ``PrefillQueue`` for the gateway's event loop."""

    def __init__(self, cfg: AdmissionConfig, clock: Callable[[], float] = time.monotonic,
                 on_waited: Callable[[str, float], None] | None = None) -> None:
        """``on_waited(released_by, seconds)``: told of every held request's wait (metrics)."""
        super().__init__(cfg.enabled, cfg.budget_tokens, cfg.max_wait_s, cfg.trust(), cfg.bypass_factor)
        self.cfg = cfg
        self._clock = clock
        self._on_waited = on_waited
        self._waiters: dict[int, asyncio.Future[None]] = {}

    def offer(self, replica: ReplicaId, predicted_uncached_tokens: int, stream: bool,
              memory_bound: bool = False) -> Ticket | None:
        return self._ticket(replica, predicted_uncached_tokens, stream, self._clock(), memory_bound)

    async def wait(self, ticket: Ticket | None) -> None:
        """Until ``ticket`` is released (see the module docstring)."""
        if ticket is None or ticket.state is not TicketState.HELD:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters[ticket.seq] = fut
        try:
            deadline = ticket.arrived_s + self.queue.max_wait_s
            while ticket.state is TicketState.HELD:
                try:
                    await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - self._clock()))
                except TimeoutError:
                    self.queue.expire(max(self._clock(), deadline))
        finally:
            self._waiters.pop(ticket.seq, None)
            if self._on_waited is not None and ticket.released_by:
                self._on_waited(ticket.released_by, self._clock() - ticket.arrived_s)

    def flush(self, replica: ReplicaId) -> None:
        """``replica`` left routing: release what is held for it (the proxy fails over)."""
        self.queue.flush(replica)

    # registry listener: a replica that leaves routing has its held requests released
    def on_added(self, view: ReplicaView) -> None:
        return None

    def on_state_changed(self, view: ReplicaView, old_state: ReplicaState) -> None:
        if not view.routable:
            self.flush(view.id)

    def on_removed(self, replica_id: ReplicaId) -> None:
        self.flush(replica_id)
        self.trust.forget(replica_id)

    def _released(self, ticket: Ticket) -> None:
        fut = self._waiters.get(ticket.seq)
        if fut is not None and not fut.done():
            fut.set_result(None)
