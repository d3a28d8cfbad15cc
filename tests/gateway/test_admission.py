"""gateway/admission.py: held requests wait on the event loop, leave cleanly, and are bounded."""
from __future__ import annotations

import asyncio

import pytest

from gateway.admission import Admission, AdmissionConfig
from prefix_index.base import ReplicaId
from replicas.admission import TicketState
from replicas.model import ReplicaState, ReplicaView

A = ReplicaId("http://a")


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_non_streaming_and_disabled_are_never_gated() -> None:
    on, off = Admission(AdmissionConfig()), Admission(AdmissionConfig(enabled=False))
    assert on.offer(A, 10**6, stream=False) is None
    assert off.offer(A, 10**6, stream=True) is None
    await on.wait(None)


async def test_a_held_request_waits_for_the_prefill_ahead_then_goes_first() -> None:
    waited: list[tuple[str, float]] = []
    adm = Admission(AdmissionConfig(budget_tokens=100), on_waited=lambda by, s: waited.append((by, s)))
    cold = adm.offer(A, 50_000, stream=True)
    await adm.wait(cold)  # released at once: nothing ahead
    order: list[str] = []
    tickets = {}

    async def turn(name: str, tokens: int) -> None:
        ticket = tickets[name] = adm.offer(A, tokens, stream=True)
        await adm.wait(ticket)
        order.append(name)

    tasks = [asyncio.create_task(turn("cold-2", 40_000)), asyncio.create_task(turn("warm", 300))]
    await _settle()
    assert order == [] and adm.held(A) == (300, 40_000)
    adm.started(cold)  # the first prefill ended (its first byte): the smaller one goes
    await _settle()
    assert order == ["warm"] and adm.held(A) == (40_000,)
    adm.started(tickets["warm"])
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == ["warm", "cold-2"]
    assert [by for by, _ in waited] == ["budget", "budget"]


async def test_the_age_bound_is_kept_on_a_fake_clock() -> None:
    now = [0.0]
    adm = Admission(AdmissionConfig(budget_tokens=1, max_wait_s=0.05), clock=lambda: now[0])
    adm.offer(A, 1000, stream=True)  # never starts (a stalled replica)
    held = adm.offer(A, 10, stream=True)
    assert held is not None and held.state is TicketState.HELD
    task = asyncio.create_task(adm.wait(held))
    await _settle()
    now[0] = 1.0  # past the bound; the wait's own timer fires within 0.05 s of real time
    await asyncio.wait_for(task, 5)
    assert held.state is TicketState.RELEASED and held.released_by == "age"


async def test_a_client_that_leaves_while_held_leaves_nothing_behind() -> None:
    adm = Admission(AdmissionConfig(budget_tokens=1))
    first = adm.offer(A, 1000, stream=True)
    held = adm.offer(A, 10, stream=True)
    task = asyncio.create_task(adm.wait(held))
    await _settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    adm.done(held)  # what the proxy's cleanup does
    assert adm.held(A) == () and not adm._waiters
    adm.done(first)
    assert adm.queue.pending_tokens(A) == 0


async def test_a_replica_leaving_routing_releases_its_held_requests() -> None:
    adm = Admission(AdmissionConfig(budget_tokens=1))
    adm.offer(A, 1000, stream=True)
    held = adm.offer(A, 10, stream=True)
    task = asyncio.create_task(adm.wait(held))
    await _settle()
    adm.on_state_changed(ReplicaView(id=A, state=ReplicaState.DRAINING), ReplicaState.ACTIVE)
    await asyncio.wait_for(task, 5)
    assert held is not None and held.released_by == "flush"
