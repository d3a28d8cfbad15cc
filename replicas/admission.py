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
  arrival order) while the replica is below the budget again, **with bounded bypass**: when
  releasing the smallest would overtake an older held request by more than its allowance,
  the oldest held request goes next instead (released by ``fairness``; it overtakes nobody);
* a request held ``max_wait_s`` is released whatever the budget (``expire``), so a cold
  request is delayed, never starved; a replica that leaves routing has everything held for
  it released (``flush``) so that the proxy's failover handles it.

Bounded bypass is the fairness guarantee. A held request's *allowance* is ``bypass_factor``
times the prefill it would wait for first come, first served: what was released and held
ahead of it when it arrived, plus its own. Requests that arrive later are released before
it for at most that many predicted tokens, whoever sent them, so its prefill wait is at
most ``1 + bypass_factor`` times its first-come-first-served one (plus the step in flight;
the default 0.5 was chosen on half of the recorded sessions, docs/benchmarks.md).
A tenant looping small requests cannot push another's large one to the age bound (issue
41: six 8k-token streams held a 30k-token stream for ~30 s under pure smallest-first),
while a warm turn can still overtake a start-up burst of cold first turns, each of which
waited for the whole burst anyway: that is where ordering pays (docs/benchmarks.md,
"Prefill admission"). Bypass is counted per replica as the tokens released from anywhere
but the head of the arrival order since the ticket was held (an over-count while older
tickets are held, so the bound errs toward arrival order); checking a release costs one
pass over the held requests older than it.

The order is only as good as the predictions. Where a replica's recent predictions were
far off (approximate mode on a replica that evicts heavily: a turn predicted cached is a
full recompute, one predicted cold was cached) ordering by them is worse than arrival
order, so ``PredictionTrust`` watches each replica's last ``window`` predictions against
the cached tokens it reported, and a replica whose share of close predictions fell below
``min_close`` is served first come, first served (its held requests released, new ones
sent at once) until its predictions are close again.

Ordering pays only where a replica runs many prefills side by side. A replica whose KV pool
is smaller than one request of the longest context it serves (``ReplicaView.memory_bound``:
/server_info's pool against /v1/models' ``max_model_len``) runs a few long requests at a
time: they queue there for memory, not for compute, a released request that does not fit
blocks the budget until one ends, and holding adds the gateway's wait to the replica's
(KV pools x0.1: TTFT p99 +10-30% with admission, docs/benchmarks.md 1.7). Such a replica is
served first come, first served from its first request, as an untrusted one is.

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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from prefix_index.base import ReplicaId

# how a held ticket was released: a prefill ahead ended (smallest first), the bypass bound
# (oldest first), the age bound (max_wait_s), the replica left routing
RELEASES = ("budget", "fairness", "age", "flush")


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
    released_by: str = ""  # a held ticket's release: RELEASES below; "" = never held
    bypass_base: int = 0  # the replica's bypass counter when it was held
    allowance: float = 0.0  # tokens of later arrivals that may be released before it

    def __lt__(self, other: Ticket) -> bool:  # the hold queue's order
        return (self.tokens, self.seq) < (other.tokens, other.seq)


@dataclass(slots=True)
class _Replica:
    pending_tokens: int = 0  # released, prefill not ended
    held: list[Ticket] = field(default_factory=list)  # heap; DONE/RELEASED entries are dropped lazily
    arrivals: deque[Ticket] = field(default_factory=deque)  # held in arrival order; dropped lazily too
    held_count: int = 0
    held_tokens: int = 0
    bypassed: int = 0  # tokens released ahead of an older held ticket, ever

    def unhold(self, t: Ticket) -> None:
        self.held_count -= 1
        self.held_tokens -= t.tokens

    def oldest(self) -> Ticket | None:
        arrivals = self.arrivals
        while arrivals and arrivals[0].state is not TicketState.HELD:
            arrivals.popleft()
        return arrivals[0] if arrivals else None

    def smallest(self) -> Ticket | None:
        heap = self.held
        while heap and heap[0].state is not TicketState.HELD:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def compact(self) -> None:
        """Bound the lazily deleted entries of both orders."""
        if len(self.held) > 2 * self.held_count + 64:
            self.held = [t for t in self.held if t.state is TicketState.HELD]
            heapq.heapify(self.held)
        if len(self.arrivals) > 2 * self.held_count + 64:
            self.arrivals = deque(t for t in self.arrivals if t.state is TicketState.HELD)


class PrefillQueue:
    """The admission rule (module docstring). ``on_release`` is told of every ticket released
    later than its ``offer`` (by ``started``/``done``/``expire``/``flush``)."""

    def __init__(self, budget_tokens: int, max_wait_s: float,
                 on_release: Callable[[Ticket], None] | None = None, bypass_factor: float = 0.5) -> None:
        if budget_tokens < 1 or max_wait_s < 0 or bypass_factor < 0:
            raise ValueError("budget_tokens must be >= 1, max_wait_s and bypass_factor >= 0")
        self.budget_tokens = budget_tokens
        self.max_wait_s = max_wait_s
        self.bypass_factor = bypass_factor
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
        t = Ticket(replica, max(0, int(tokens)), now_s, next(self._seq), r, bypass_base=r.bypassed)
        if r.held_count == 0 and r.pending_tokens < self.budget_tokens:
            self._release(r, t)
            return t
        # first come, first served it would wait for what is ahead and its own prefill
        t.allowance = self.bypass_factor * (r.pending_tokens + r.held_tokens + t.tokens)
        heapq.heappush(r.held, t)
        r.arrivals.append(t)
        r.held_count += 1
        r.held_tokens += t.tokens
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
            r = ticket.home
            r.unhold(ticket)
            r.compact()

    def expire(self, now_s: float) -> list[Ticket]:
        """Release every ticket held for ``max_wait_s`` or longer; returns them."""
        out: list[Ticket] = []
        ages = self._ages
        while ages and ages[0][0] <= now_s:
            t = heapq.heappop(ages)[2]
            if t.state is TicketState.HELD:
                self.expired_total += 1
                r = t.home
                r.unhold(t)
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
        r.held, r.arrivals, r.held_count, r.held_tokens = [], deque(), 0, 0
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
        while r.held_count and r.pending_tokens < self.budget_tokens:
            t, oldest = r.smallest(), r.oldest()
            assert t is not None and oldest is not None
            by = "budget"
            if t is not oldest:
                if self._over_bound(r, t):
                    t, by = oldest, "fairness"  # the oldest overtakes nobody
                else:
                    r.bypassed += t.tokens
            r.unhold(t)
            self._release(r, t, by)
            self._notify(t)
        if not r.held_count:
            r.held.clear()
            r.arrivals.clear()
        else:
            r.compact()

    def _over_bound(self, r: _Replica, candidate: Ticket) -> bool:
        """Would releasing ``candidate`` now overtake an older held ticket beyond its bound?"""
        for t in r.arrivals:  # arrival order: every held ticket older than the candidate
            if t is candidate:
                return False
            if (t.state is TicketState.HELD
                    and r.bypassed - t.bypass_base + candidate.tokens > t.allowance):
                return True
        return False

    def _notify(self, t: Ticket) -> None:
        if self.on_release is not None:
            self.on_release(t)


class PredictionTrust:
    """Per replica: were its last ``window`` predictions of cached tokens close? (pure)

    Close: within ``tolerance_tokens`` or ``tolerance_share`` of the prompt, whichever is
    larger. A replica is trusted until ``min_samples`` predictions are known, then while
    at least ``min_close`` of the last ``window`` were close."""

    def __init__(self, window: int = 64, min_samples: int = 16, min_close: float = 0.9,
                 tolerance_tokens: int = 1024, tolerance_share: float = 0.1) -> None:
        self.window, self.min_samples, self.min_close = window, min_samples, min_close
        self.tolerance_tokens, self.tolerance_share = tolerance_tokens, tolerance_share
        self._seen: dict[ReplicaId, deque[bool]] = {}
        self._close: dict[ReplicaId, int] = {}

    def observe(self, replica: ReplicaId, predicted_cached: int, reported_cached: int, prompt_tokens: int) -> None:
        seen = self._seen.setdefault(replica, deque())
        close = abs(predicted_cached - reported_cached) <= max(self.tolerance_tokens,
                                                              self.tolerance_share * prompt_tokens)
        seen.append(close)
        self._close[replica] = self._close.get(replica, 0) + close
        if len(seen) > self.window:
            self._close[replica] -= seen.popleft()

    def trusted(self, replica: ReplicaId) -> bool:
        seen = self._seen.get(replica)
        if seen is None or len(seen) < self.min_samples:
            return True
        return self._close[replica] >= self.min_close * len(seen)

    def forget(self, replica: ReplicaId) -> None:
        self._seen.pop(replica, None)
        self._close.pop(replica, None)


class AdmissionFront:
    """What the gateway's and the simulator's fronts share: which requests are gated (only
    streaming ones, when enabled), the held sizes for views, and the ticket's two ends,
    each tolerating an ungated request (``None``)."""

    def __init__(self, enabled: bool, budget_tokens: int, max_wait_s: float,
                 trust: PredictionTrust | None = None, bypass_factor: float = 0.5) -> None:
        self.enabled = enabled
        self.queue = PrefillQueue(budget_tokens, max_wait_s, self._released, bypass_factor)
        self.trust = trust or PredictionTrust()

    def _ticket(self, replica: ReplicaId, tokens: int, stream: bool, now_s: float,
                memory_bound: bool = False) -> Ticket | None:
        if not self.enabled or not stream:
            return None
        if memory_bound or not self.trust.trusted(replica):
            self.queue.flush(replica)  # first come, first served there (module docstring)
            return None
        return self.queue.offer(replica, tokens, now_s)

    def observe(self, replica: ReplicaId, predicted_cached: int, reported_cached: int | None,
                prompt_tokens: int | None) -> None:
        """A served request's prediction against what the replica reported (``PredictionTrust``)."""
        if reported_cached is not None and prompt_tokens:
            self.trust.observe(replica, predicted_cached, reported_cached, prompt_tokens)

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
