"""Admission trusts a replica's order only while its predictions were close (replicas/admission.py)."""
from __future__ import annotations

from prefix_index.base import ReplicaId
from replicas.admission import AdmissionFront, PredictionTrust, TicketState

A = ReplicaId("http://a")


def test_trusted_until_enough_predictions_then_by_their_share() -> None:
    trust = PredictionTrust(window=10, min_samples=4, min_close=0.9, tolerance_tokens=100, tolerance_share=0.1)
    for _ in range(3):
        trust.observe(A, 0, 50_000, 60_000)  # far off, but too few to judge
    assert trust.trusted(A)
    trust.observe(A, 0, 50_000, 60_000)
    assert not trust.trusted(A)
    for _ in range(10):  # close again: within 10% of the prompt
        trust.observe(A, 50_000, 54_000, 60_000)
    assert trust.trusted(A)
    trust.observe(A, 0, 90, 100)  # within tolerance_tokens
    assert trust.trusted(A)
    trust.forget(A)
    assert trust.trusted(A)


def test_an_untrusted_replica_is_first_come_first_served() -> None:
    front = AdmissionFront(True, budget_tokens=10, max_wait_s=30.0,
                           trust=PredictionTrust(window=4, min_samples=4, min_close=0.9))
    big = front._ticket(A, 10_000, True, 0.0)
    held = front._ticket(A, 5, True, 0.0)
    assert big is not None and held is not None and held.state is TicketState.HELD
    for _ in range(4):
        front.observe(A, 0, 80_000, 100_000)  # a replica evicting what the gateway thinks it holds
    assert front._ticket(A, 5, True, 1.0) is None  # sent at once, not gated
    assert held.state is TicketState.RELEASED and held.released_by == "flush"  # nothing waits on the order
    assert front.held(A) == ()
    front.observe(A, 0, None, 100)  # no usage reported: nothing learnt
    assert not front.trust.trusted(A)
