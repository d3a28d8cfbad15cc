"""The prefill admission rule (replicas/admission.py): pure, no clock."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_index.base import ReplicaId
from replicas.admission import PrefillQueue, Ticket, TicketState
from replicas.model import ReplicaState, ReplicaView

A, B = ReplicaId("http://a"), ReplicaId("http://b")


def queue(budget: int = 100, max_wait_s: float = 10.0) -> tuple[PrefillQueue, list[Ticket]]:
    released: list[Ticket] = []
    return PrefillQueue(budget, max_wait_s, released.append), released


def test_below_the_budget_everything_is_sent_at_once() -> None:
    q, later = queue(budget=100)
    t1 = q.offer(A, 40, 0.0)
    t2 = q.offer(A, 50, 0.0)
    assert (t1.state, t2.state) == (TicketState.RELEASED, TicketState.RELEASED)
    assert q.pending_tokens(A) == 90 and later == []


def test_held_requests_go_smallest_first_when_a_prefill_ends() -> None:
    q, later = queue(budget=100)
    big = q.offer(A, 5000, 0.0)
    held = [q.offer(A, n, 0.1 * i) for i, n in enumerate((3000, 20, 700, 20))]
    assert all(t.state is TicketState.HELD for t in held)
    assert q.held_sizes(A) == (20, 20, 700, 3000)
    q.started(big)
    # the two 20-token turns (arrival order), then 700 brings the replica over the budget
    assert [(t.tokens, t.seq) for t in later] == [(20, held[1].seq), (20, held[3].seq), (700, held[2].seq)]
    assert q.held_sizes(A) == (3000,)
    assert all(t.released_by == "budget" for t in later)
    for t in list(later):
        q.started(t)
    assert later[-1].tokens == 3000 and q.held(A) == 0


def test_a_new_request_never_overtakes_a_held_one_while_over_budget() -> None:
    q, _ = queue(budget=100)
    q.offer(A, 500, 0.0)
    small = q.offer(A, 10, 0.0)
    assert small.state is TicketState.HELD  # over budget: held, then ordered
    other = q.offer(B, 10, 0.0)
    assert other.state is TicketState.RELEASED  # replicas are independent


def test_the_age_bound_releases_a_starved_request() -> None:
    q, later = queue(budget=100, max_wait_s=5.0)
    q.offer(A, 500, 0.0)
    cold = q.offer(A, 4000, 1.0)
    assert q.next_deadline_s() == 6.0
    assert q.expire(5.9) == []
    assert q.expire(6.0) == [cold] and cold.released_by == "age"
    assert later == [cold] and q.expired_total == 1 and q.next_deadline_s() is None


def test_a_client_that_leaves_while_held_takes_nothing_with_it() -> None:
    q, later = queue(budget=100)
    big = q.offer(A, 500, 0.0)
    gone = q.offer(A, 10, 0.0)
    q.done(gone)
    q.done(gone)  # idempotent
    assert q.held(A) == 0 and gone.state is TicketState.DONE
    q.done(big)
    assert later == [] and q.pending_tokens(A) == 0
    assert q.expire(1e9) == []


def test_flush_releases_everything_held_for_a_replica_that_left() -> None:
    q, later = queue(budget=100)
    big = q.offer(A, 500, 0.0)
    held = [q.offer(A, n, 0.0) for n in (30, 10)]
    assert q.flush(A) == sorted(held)
    assert [t.released_by for t in later] == ["flush", "flush"] and q.held() == 0
    q.done(big)  # tickets of a flushed replica end without touching a new one
    for t in held:
        q.done(t)
    assert q.offer(A, 10, 1.0).state is TicketState.RELEASED and q.pending_tokens(A) == 10


ops = st.lists(st.tuples(st.sampled_from(["offer", "started", "done", "expire", "flush"]),
                         st.integers(0, 1), st.integers(0, 20_000)), max_size=80)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_invariants_over_any_sequence(steps: list[tuple[str, int, int]]) -> None:
    """Pending is the sum of released, unstarted tickets; nothing is lost; ends drain it all."""
    q, _ = queue(budget=8192, max_wait_s=30.0)
    replicas, tickets, now = (A, B), [], 0.0
    for op, which, n in steps:
        now += 1.0
        rid = replicas[which]
        if op == "offer":
            tickets.append(q.offer(rid, n, now))
        elif op in ("started", "done") and tickets:
            getattr(q, op)(tickets[n % len(tickets)])
        elif op == "expire":
            q.expire(now)
        elif op == "flush":
            q.flush(rid)
        for t in tickets:
            assert t.state in TicketState
        for r in replicas:
            live = [t for t in tickets if t.home is q._replicas[r]] if r in q._replicas else []
            assert q.pending_tokens(r) == sum(t.tokens for t in live if t.state is TicketState.RELEASED)
            assert q.held(r) == sum(t.state is TicketState.HELD for t in live)
    q.expire(now + 31.0)  # the age bound releases every held ticket
    assert all(t.state is not TicketState.HELD for t in tickets)
    for t in tickets:
        q.done(t)
    assert q.pending_tokens(A) == q.pending_tokens(B) == 0 and q.held() == 0


def test_the_view_counts_only_the_prefill_that_goes_first() -> None:
    view = ReplicaView(id=A, state=ReplicaState.ACTIVE, pending_prefill_tokens=9_000 + 800 + 70_000,
                       held_prefill=(800, 70_000), reported_waiting_uncached_tokens=5_000)
    assert view.prefill_ahead(500) == 9_000  # a warm turn: only what was released
    assert view.prefill_ahead(1_000) == 9_800
    assert view.prefill_ahead(100_000) == 79_800  # a cold one waits for everything
    fifo = ReplicaView(id=A, state=ReplicaState.ACTIVE, pending_prefill_tokens=3_000,
                       reported_waiting_uncached_tokens=5_000)
    assert fifo.prefill_ahead(1) == 5_000  # nothing held: first come, first served (the max)


def test_clients_leaving_while_held_do_not_grow_the_queue() -> None:
    q, _ = queue(budget=1)
    q.offer(A, 100, 0.0)  # never starts: everything after it is held
    keep = q.offer(A, 5, 0.0)
    for i in range(10_000):
        q.done(q.offer(A, 10, float(i)))
    assert q.held(A) == 1 and len(q._replicas[A].held) <= 2 * 1 + 64 + 1
    assert q.held_sizes(A) == (keep.tokens,)


def test_bypass_is_bounded_by_the_factor_times_the_first_come_first_served_wait() -> None:
    """Issue 41's attack: small requests arriving after a large one overtake it only until
    they add up to bypass_factor x what it would wait for first come, first served (the
    prefill ahead of it when it arrived, plus its own); then it goes next (oldest first)."""
    released: list[Ticket] = []
    q = PrefillQueue(100, 1e9, released.append, bypass_factor=1.0)
    first = q.offer(A, 8_000, 0.0)
    victim = q.offer(A, 30_000, 1.0)
    assert victim.allowance == 38_000  # the 8k released ahead of it, and its own 30k
    attackers = [q.offer(A, 8_000, 2.0 + i) for i in range(6)]
    running = first
    while victim.state is TicketState.HELD:
        q.started(running)
        running = released[-1]
    overtook = [t for t in released if t is not victim]
    assert len(overtook) == 4 and sum(t.tokens for t in overtook) <= victim.allowance  # a 5th would pass it
    assert victim.released_by == "fairness" and all(t.released_by == "budget" for t in overtook)
    assert released.index(victim) == 4 and attackers[4].state is TicketState.HELD


def test_factor_zero_is_first_come_first_served() -> None:
    released: list[Ticket] = []
    q = PrefillQueue(100, 1e9, released.append, bypass_factor=0.0)
    running = q.offer(A, 500, 0.0)
    held = [q.offer(A, n, 0.1 * i) for i, n in enumerate((3000, 20, 700, 20))]
    for _ in held:
        q.started(running)
        running = released[-1]
    assert released == held


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20_000), st.booleans()), min_size=1, max_size=60),
       st.sampled_from([0.0, 0.5, 1.0, 2.0]))
def test_no_held_ticket_is_overtaken_by_more_than_its_bound(arrivals: list[tuple[int, bool]], factor: float) -> None:
    """Whatever arrives and whenever prefills end, the tokens of later arrivals released
    before a ticket never exceed its allowance: bypass_factor x (the prefill released or
    held when it arrived + its own)."""
    released: list[Ticket] = []
    q = PrefillQueue(1, 1e9, released.append, bypass_factor=factor)
    running: list[Ticket] = []
    tickets: list[Ticket] = []
    for now, (tokens, finish) in enumerate(arrivals):
        t = q.offer(A, tokens, float(now))
        tickets.append(t)
        if t.state is TicketState.RELEASED:
            running.append(t)
        if finish and running:
            q.started(running.pop(0))
            running.extend(x for x in released if x not in running and x.state is TicketState.RELEASED)
    while q.held(A):
        q.started(running.pop(0))
        running.extend(x for x in released if x not in running and x.state is TicketState.RELEASED)
    order = {id(t): i for i, t in enumerate(released)}
    for t in (x for x in tickets if id(x) in order):
        overtaking = sum(x.tokens for x in tickets if x.seq > t.seq and id(x) in order
                         and order[id(x)] < order[id(t)])
        assert overtaking <= t.allowance
