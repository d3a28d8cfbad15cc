"""Prefill admission in virtual time: the gateway's rule (``replicas.admission``) on the fleet's clock.

``gateway.admission`` holds a streaming request on a future; here a held request's send
is kept until the rule releases it: when a prefill ahead ends (``started``, the first
token), when it ends (``done``), or at its age bound (an event at ``arrived + max_wait_s``
on the ``VirtualFleet``). A release triggered from inside an engine callback is sent as
an event at the same simulated time, so engines are never re-entered.
"""
from __future__ import annotations

from collections.abc import Callable

from gateway.admission import AdmissionConfig
from loadtest.simulator.clock import VirtualFleet
from prefix_index.base import ReplicaId
from replicas.admission import AdmissionFront, Ticket, TicketState


class SimAdmission(AdmissionFront):
    """The admission of one simulated gateway (see the module docstring)."""

    def __init__(self, cfg: AdmissionConfig, fleet: VirtualFleet) -> None:
        super().__init__(cfg.enabled, cfg.budget_tokens, cfg.max_wait_s, cfg.trust(), cfg.bypass_factor)
        self.fleet = fleet
        self._sends: dict[int, Callable[[], None]] = {}

    def offer(self, replica: ReplicaId, tokens: int, stream: bool, now_s: float,
              memory_bound: bool = False) -> Ticket | None:
        """The request's ticket (None: not gated); then `send_or_hold` it."""
        return self._ticket(replica, tokens, stream, now_s, memory_bound)

    def send_or_hold(self, ticket: Ticket | None, send: Callable[[], None]) -> None:
        """``send()`` now if released, else when the rule releases the ticket. (Two steps, so
        the caller holds the ticket before a send whose engine may finish it at once.)"""
        if ticket is None or ticket.state is TicketState.RELEASED:
            send()
            return
        self._sends[ticket.seq] = send
        self.fleet.schedule(ticket.arrived_s + self.queue.max_wait_s, self._expire)

    def _expire(self, now_s: float) -> None:
        self.queue.expire(now_s)

    def _released(self, ticket: Ticket) -> None:
        send = self._sends.pop(ticket.seq, None)
        if send is not None:
            self.fleet.schedule(self.fleet.now_s, lambda _now_s: send())
