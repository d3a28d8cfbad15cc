"""Memory-bound replicas (KV pool smaller than one full-context request) are served first
come, first served: prefill admission holds nothing for them (replicas/model.py,
replicas/admission.py; docs/benchmarks.md 1.7)."""
from __future__ import annotations

from gateway.admin import view_json
from prefix_index.base import ReplicaId
from replicas.admission import AdmissionFront, TicketState
from replicas.model import ReplicaState, ReplicaView, memory_bound
from replicas.probe import Capacity, parse_server_info, with_context
from tests.replicas.fakes import server_info_body

A = ReplicaId("http://a")


def test_memory_bound_only_when_both_figures_are_known_and_the_pool_is_smaller() -> None:
    assert memory_bound(200_000, 262_144)
    assert not memory_bound(262_144, 262_144) and not memory_bound(2_000_000, 262_144)
    assert not memory_bound(0, 262_144) and not memory_bound(200_000, 0)  # unknown: not bound
    view = ReplicaView(id=A, state=ReplicaState.ACTIVE, device_tokens=200_000, context_tokens=262_144)
    assert view.memory_bound
    assert not ReplicaView(id=A, state=ReplicaState.ACTIVE, device_tokens=200_000).memory_bound
    assert Capacity(device_tokens=4096, context_tokens=8192).memory_bound and not Capacity().memory_bound
    shown = view_json(view, 0.0)
    assert shown["memory_bound"] is True and shown["context_tokens"] == 262_144


def test_context_from_server_info_then_the_model_cards() -> None:
    body = server_info_body()
    body["context_length"] = None  # SGLang's raw CLI value: null when unset
    cap = parse_server_info(body)
    assert cap.context_tokens == 0
    body["context_length"] = 65_536
    assert parse_server_info(body).context_tokens == 65_536
    cards = [{"id": "a", "max_model_len": 131_072}, {"id": "b", "max_model_len": 262_144}, {"id": "c"}]
    assert with_context(Capacity(context_tokens=65_536), cards).context_tokens == 262_144  # the effective one
    assert with_context(Capacity(context_tokens=65_536), [{"id": "a"}]).context_tokens == 65_536
    assert with_context(Capacity(), [{"id": "a", "max_model_len": "x"}]).context_tokens == 0


def test_a_memory_bound_replica_holds_nothing_and_releases_what_it_held() -> None:
    front = AdmissionFront(True, budget_tokens=10, max_wait_s=30.0)
    first = front._ticket(A, 10_000, True, 0.0)
    held = front._ticket(A, 5, True, 0.0)
    assert first is not None and held is not None and held.state is TicketState.HELD
    assert front._ticket(A, 50_000, True, 1.0, memory_bound=True) is None  # sent at once
    assert held.state is TicketState.RELEASED and held.released_by == "flush"
    assert front.held(A) == ()
    assert front._ticket(A, 5, True, 2.0, memory_bound=True) is None
    assert front.queue.held_total == 1  # nothing more was ever held
