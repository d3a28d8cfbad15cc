"""Prefill admission: hold streaming requests in the gateway, release them shortest prefill first.

A replica serves prefills first come, first served: a warm agent turn (a few hundred
uncached tokens) that reaches a replica behind a burst of cold 70k-token first turns
waits for all of them. The gateway knows, per request, the uncached tokens it predicted
and when the prefill ended (the first streamed byte), so it can keep the replica's queue
short and choose the order itself:

* a request *released* to a replica counts its predicted uncached tokens there until its
  prefill ends (``started``) or it ends (``done``);
* a new request is released at once while the replica's released, unstarted prefill is
  below ``budget_tokens`` and nobody is held for it; otherwise it is *held*;
* when a prefill ends, held requests are released smallest predicted prefill first (ties:
  arrival order) while the replica is below the budget again;
* a request held ``max_wait_s`` is released whatever the budget (``expire``), so a cold
  request is delayed, never starved; a replica that leaves routing has everything held for
  it released (``flush``) so that the proxy's failover handles it.

The routing decision is made before admission (the held request already counts in the
replica's load through its lease), so holding never changes where a request goes, only
when it is sent. Only what the gateway can observe is gated: non-streaming requests (whose
first byte is the end of the whole generation) bypass it (``gated=False`` in the proxy).

This module is pure (no clock, no asyncio): ``gateway.admission`` wraps it with futures
for the proxy, ``loadtest.fleetsim`` with virtual-time events, so both run the same rule.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from prefix_index.base import ReplicaId


class TicketState(Enum):
    HELD = "held"
    RELEASED = "released"
    DONE = "done"


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's place in admission (identity-compared)."""

    replica: ReplicaId
    tokens: int
    arrived_s: float
    seq: int
    home: _Replica = field(repr=False)  # the per-replica state it counts in (survives a flush)
    state: TicketState = TicketState.HELD
    released_by: str = ""  # a held ticket's release: "budget", "age" (max_wait_s) or "flush"; "" = never held

    def __lt__(self, other: Ticket) -> bool:  # the hold queue's order
        return (self.tokens, self.seq) < (other.tokens, other.seq)


@dataclass(slots=True)
class _Replica:
    pending_tokens: int = 0  # released, prefill not ended
    held: list[Ticket] = field(default_factory=list)  # heap; DONE/RELEASED entries are dropped lazily
    held_count: int = 0


class PrefillQueue:
    """The admission rule (module docstring). ``on_release`` is told of every ticket released
    later than its ``offer`` (by ``started``/``done``/``expire``/``flush``)."""

    def __init__(self, budget_tokens: int, max_wait_s: float,
                 on_release: Callable[[Ticket], None] | None = None) -> None:
        if budget_tokens < 1 or max_wait_s < 0:
            raise ValueError("budget_tokens must be >= 1 and max_wait_s >= 0")
        self.budget_tokens = budget_tokens
        self.max_wait_s = max_wait_s
        self.on_release = on_release
        self._replicas: dict[ReplicaId, _Replica] = {}
        self._ages: list[tuple[float, int, Ticket]] = []  # (deadline, seq, ticket), lazily cleaned
        self._seq = itertools.count()
        self.released_total = 0
        self.held_total = 0
        self.expired_total = 0

    # -- what callers read ---------------------------------------------------------------
    def held(self, replica: ReplicaId | None = None) -> int:
        """Requests held now (for one replica, or all)."""
        if replica is not None:
            r = self._replicas.get(replica)
            return r.held_count if r else 0
        return sum(r.held_count for r in self._replicas.values())

    def held_sizes(self, replica: ReplicaId) -> tuple[int, ...]:
        """Predicted prefill tokens of the requests held for ``replica``, smallest first."""
        r = self._replicas.get(replica)
        if r is None or not r.held_count:
            return ()
        return tuple(sorted(t.tokens for t in r.held if t.state is TicketState.HELD))

    def pending_tokens(self, replica: ReplicaId) -> int:
        r = self._replicas.get(replica)
        return r.pending_tokens if r else 0

    def next_deadline_s(self) -> float | None:
        """When the oldest held request reaches the age bound (None: nothing held)."""
        ages = self._ages
        while ages and ages[0][2].state is not TicketState.HELD:
            heapq.heappop(ages)
        return ages[0][0] if ages else None

    # -- transitions ---------------------------------------------------------------------
    def offer(self, replica: ReplicaId, tokens: int, now_s: float) -> Ticket:
        """A routed request; its ticket is RELEASED (send now) or HELD (wait)."""
        r = self._replicas.setdefault(replica, _Replica())
        t = Ticket(replica, max(0, int(tokens)), now_s, next(self._seq), r)
        if r.held_count == 0 and r.pending_tokens < self.budget_tokens:
            self._release(r, t)
            return t
        heapq.heappush(r.held, t)
        r.held_count += 1
        self.held_total += 1
        heapq.heappush(self._ages, (now_s + self.max_wait_s, t.seq, t))
        return t

    def started(self, ticket: Ticket) -> None:
        """The ticket's prefill ended (its first byte): its tokens no longer count."""
        if ticket.state is TicketState.RELEASED:
            ticket.state = TicketState.DONE
            r = ticket.home
            r.pending_tokens -= ticket.tokens
            self._drain(r)

    def done(self, ticket: Ticket) -> None:
        """The request ended (or left) in any state; idempotent."""
        if ticket.state is TicketState.RELEASED:
            self.started(ticket)
        elif ticket.state is TicketState.HELD:
            ticket.state = TicketState.DONE
            ticket.home.held_count -= 1

    def expire(self, now_s: float) -> list[Ticket]:
        """Release every ticket held for ``max_wait_s`` or longer; returns them."""
        out: list[Ticket] = []
        ages = self._ages
        while ages and ages[0][0] <= now_s:
            t = heapq.heappop(ages)[2]
            if t.state is TicketState.HELD:
                self.expired_total += 1
                r = t.home
                r.held_count -= 1
                self._release(r, t, "age")
                out.append(t)
                self._notify(t)
        return out

    def flush(self, replica: ReplicaId) -> list[Ticket]:
        """Release everything held for ``replica`` (it left routing) and forget it."""
        r = self._replicas.pop(replica, None)
        if r is None:
            return []
        out = sorted(t for t in r.held if t.state is TicketState.HELD)
        r.held, r.held_count = [], 0
        for t in out:
            self._release(r, t, "flush")
            self._notify(t)
        return out

    # -- internals -----------------------------------------------------------------------
    def _release(self, r: _Replica, t: Ticket, by: str = "") -> None:
        t.state = TicketState.RELEASED
        t.released_by = by
        r.pending_tokens += t.tokens
        self.released_total += 1

    def _drain(self, r: _Replica) -> None:
        heap = r.held
        while heap and r.pending_tokens < self.budget_tokens:
            t = heapq.heappop(heap)
            if t.state is not TicketState.HELD:
                continue
            r.held_count -= 1
            self._release(r, t, "budget")
            self._notify(t)
        if not r.held_count:
            heap.clear()

    def _notify(self, t: Ticket) -> None:
        if self.on_release is not None:
            self.on_release(t)


class AdmissionFront:
    """What the gateway's and the simulator's fronts share: which requests are gated (only
    streaming ones, when enabled), the held sizes for views, and the ticket's two ends,
    each tolerating an ungated request (``None``)."""

    def __init__(self, enabled: bool, budget_tokens: int, max_wait_s: float) -> None:
        self.enabled = enabled
        self.queue = PrefillQueue(budget_tokens, max_wait_s, self._released)

    def _ticket(self, replica: ReplicaId, tokens: int, stream: bool, now_s: float) -> Ticket | None:
        if not self.enabled or not stream:
            return None
        return self.queue.offer(replica, tokens, now_s)

    def held(self, replica: ReplicaId) -> tuple[int, ...]:
        """Predicted prefill tokens of the requests held for ``replica`` (for its view)."""
        return self.queue.held_sizes(replica)

    def started(self, ticket: Ticket | None) -> None:
        """The request's first byte: its prefill ended."""
        if ticket is not None:
            self.queue.started(ticket)

    def done(self, ticket: Ticket | None) -> None:
        """The request ended (any way, any state); idempotent."""
        if ticket is not None:
            self.queue.done(ticket)

    def _released(self, ticket: Ticket) -> None:
        """A held ticket was released (override: wake its waiter / send it)."""
