"""Shared replica state across gateways, against a real redis-server."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import httpx
import pytest

from replicas.config import RegistryConfig, SharedStateConfig
from replicas.load import LoadCounters
from replicas.model import ReplicaState
from replicas.registry import Registry
from replicas.shared_state import SharedState
from tests.replicas.fakes import FakeClock, FakeFleet, RecordingListener
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.redis

X, Y, Z = "http://127.0.0.1:32001", "http://127.0.0.1:32002", "http://127.0.0.1:32003"
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    server = RedisServer()
    server.start()
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture
def fleet() -> FakeFleet:
    f = FakeFleet()
    for url in (X, Y, Z):
        f.add(url)
    return f


@pytest.fixture
async def client(fleet: FakeFleet) -> AsyncIterator[httpx.AsyncClient]:
    async with fleet.client() as c:
        yield c


class Gateways:
    """Registries sharing one Redis key prefix; closes their Redis clients at the end."""

    def __init__(self, redis_url: str, client: httpx.AsyncClient, **shared: object) -> None:
        self.cfg = SharedStateConfig.model_validate(
            {"redis_url": redis_url, "key_prefix": f"test{next(_prefixes)}:", **shared}
        )
        self.client = client
        self.states: list[SharedState] = []

    def state(self, name: str) -> SharedState:
        s = SharedState.from_url(self.cfg, gateway_id=name)
        self.states.append(s)
        return s

    def registry(
        self, name: str, clock: Callable[[], float] = time.monotonic, **cfg: object
    ) -> Registry:
        config = RegistryConfig.model_validate({"shared": self.cfg, **cfg})
        return Registry(config, self.client, clock=clock, shared=self.state(name))

    async def close(self) -> None:
        for s in self.states:
            await s.redis.aclose()


@pytest.fixture
async def gateways(redis_url: str, client: httpx.AsyncClient) -> AsyncIterator[Gateways]:
    g = Gateways(redis_url, client)
    yield g
    await g.close()


async def wait_for(cond: Callable[[], bool | Awaitable[bool]], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got if isinstance(got, bool) else await got:
            return
        await asyncio.sleep(0.02)
    raise TimeoutError("condition not met in time")


def state_of(reg: Registry, url: str) -> ReplicaState | None:
    v = reg.get(url)
    return v.state if v else None


async def test_membership_and_drain_propagate_in_one_sync(gateways: Gateways) -> None:
    a, b = gateways.registry("a"), gateways.registry("b")
    events = RecordingListener()
    b.add_listener(events)
    await a.add(X)
    await a.add(Y)
    await b.sync_shared()
    await b.probe_all()
    assert [v.id for v in b.views()] == [X, Y] and state_of(b, X) is ReplicaState.ACTIVE
    b.lease(Y, 10)
    await a.drain(Y, deadline_s=60)  # not removed at once: A may not have seen B's leases yet
    await b.sync_shared()  # one sync interval (0.25 s by default) is all it takes
    v = b.get(Y)
    assert v is not None and v.state is ReplicaState.DRAINING and v.drain_deadline_s is not None
    await a.undrain(Y)
    await b.sync_shared()
    assert state_of(b, Y) is ReplicaState.ACTIVE
    a.set_removal_candidate(X, True)
    await wait_for(lambda: _synced_candidate(b, X))
    await a.remove(X)
    await b.sync_shared()
    assert b.get(X) is None
    assert ("added", X, "joining") in events.events and ("removed", X, "") in events.events


async def _synced_candidate(reg: Registry, url: str) -> bool:
    await reg.sync_shared()
    v = reg.get(url)
    return v is not None and v.removal_candidate


async def test_drain_seen_by_a_running_gateway(gateways: Gateways) -> None:
    a = gateways.registry("a", replicas=[X, Y])
    b = gateways.registry("b", replicas=[X, Y])
    await a.start()
    await b.start()
    try:
        lease = b.lease(X, 10)
        await a.drain(X, deadline_s=60)
        await wait_for(lambda: state_of(b, X) is ReplicaState.DRAINING)
        lease.release()  # B's last request on X ends: both gateways drop X once B published it
        await wait_for(lambda: a.get(X) is None and b.get(X) is None)
        assert [v.id for v in a.views()] == [Y] == [v.id for v in b.views()]
    finally:
        await a.stop()
        await b.stop()


async def test_drain_waits_for_other_gateways_in_flight(gateways: Gateways) -> None:
    clock = FakeClock()
    a, b = gateways.registry("a", clock=clock), gateways.registry("b", clock=clock)
    await a.add(X)
    await b.sync_shared()
    leases = [b.lease(X, 100), b.lease(X, 100)]
    leases[0].first_byte()
    await b.sync_shared()
    await a.sync_shared()
    v = a.get(X)
    assert v is not None and (v.in_flight, v.pending_prefill_tokens, v.decoding) == (2, 100, 1)
    await a.drain(X)
    await b.sync_shared()
    clock.advance(10)
    a.check_drains()
    assert state_of(a, X) is ReplicaState.DRAINING  # B still has two requests on it
    for lease in leases:
        lease.release()
    await b.sync_shared()
    await a.sync_shared()
    assert a.get(X) is None
    await b.sync_shared()
    assert b.get(X) is None


async def test_crashed_gateways_leases_expire(redis_url: str, client: httpx.AsyncClient) -> None:
    g = Gateways(redis_url, client, lease_ttl_s=0.3)
    try:
        a = g.registry("a")
        crashed = g.state("crashed")
        await a.add(X)
        await crashed.sync({X: LoadCounters(in_flight=5, pending_prefill_tokens=900, decoding=2)})
        await a.sync_shared()
        v = a.get(X)
        assert v is not None and (v.in_flight, v.pending_prefill_tokens, v.decoding) == (5, 900, 2)
        # "crashed" never refreshes again: its lease runs out by itself
        await wait_for(lambda: _in_flight_after_sync(a, X, 0))
    finally:
        await g.close()


async def _in_flight_after_sync(reg: Registry, url: str, expected: int) -> bool:
    await reg.sync_shared()
    v = reg.get(url)
    return v is not None and v.in_flight == expected


async def test_reserve_spreads_concurrent_reservations(gateways: Gateways) -> None:
    s1, s2 = gateways.state("g1"), gateways.state("g2")
    picks = await asyncio.gather(*(s.reserve([X, Y, Z], 100) for s in [s1, s2] * 15))
    assert Counter(picks) == {X: 10, Y: 10, Z: 10}


async def test_reserve_through_registries_avoids_herding(gateways: Gateways) -> None:
    a, b = gateways.registry("a"), gateways.registry("b")
    for url in (X, Y):
        await a.add(url)
    await b.sync_shared()
    await b.probe_all()
    # both gateways' snapshots say X is the best: without reserve both would herd on X
    leases = await asyncio.gather(*(r.reserve([X, Y], 50) for r in [a, b] * 4))
    assert Counter(lease.replica for lease in leases) == {X: 4, Y: 4}
    await a.sync_shared()
    await b.sync_shared()
    await a.sync_shared()
    v = a.get(Y)
    assert v is not None and v.in_flight == 4 and v.pending_prefill_tokens == 200
    for lease in leases:
        lease.release()


async def test_redis_down_degrades_then_resumes(client: httpx.AsyncClient) -> None:
    server = RedisServer()
    server.start()
    g = Gateways(server.url, client, sync_budget_s=0.5, op_budget_s=0.5, reserve_budget_s=0.5)
    try:
        clock = FakeClock()
        a, b = g.registry("a", clock=clock), g.registry("b", clock=clock)
        await a.add(X)
        await b.sync_shared()
        server.stop()
        await a.sync_shared()
        assert a.shared_degraded and a.degraded_total == 1
        await a.add(Y)  # local only
        lease = await a.reserve([Y, X], 10)  # the first candidate, no Redis call
        assert lease.replica == Y and a.get(Y).in_flight == 1  # type: ignore[union-attr]
        await a.drain(Y, deadline_s=5)
        assert a.degraded_total == 4 and state_of(a, Y) is ReplicaState.DRAINING
        clock.advance(5)
        a.check_drains()
        assert [v.id for v in a.views()] == [X]
        lease.release()
        server.start()  # same port, empty data
        await wait_for(lambda: _resumed(a))
        await b.sync_shared()  # b is not degraded but sees a new epoch: republishes its view
        await b.sync_shared()
        await a.sync_shared()
        assert [v.id for v in a.views()] == [X] and [v.id for v in b.views()] == [X]
        await a.add(Z)
        await b.sync_shared()
        assert [v.id for v in b.views()] == [X, Z]
    finally:
        await g.close()
        server.close()


async def _resumed(reg: Registry) -> bool:
    await reg.sync_shared()
    return not reg.shared_degraded


async def test_slow_redis_counts_as_degraded(redis_url: str, client: httpx.AsyncClient) -> None:
    g = Gateways(redis_url, client, sync_budget_s=0.05, reserve_budget_s=0.05)
    try:
        a = g.registry("a")
        await a.add(X)
        await a.add(Y)
        admin = g.state("admin")
        await admin.redis.client_pause(300)
        await a.sync_shared()
        assert a.shared_degraded and a.degraded_total >= 1
        assert (await a.reserve([Y, X], 1)).replica == Y  # degraded: local choice at once
        await wait_for(lambda: _resumed(a))
        assert [v.id for v in a.views()] == [X, Y]
    finally:
        await g.close()


async def test_stop_withdraws_this_gateways_load_at_once(gateways: Gateways) -> None:
    a = gateways.registry("a")
    await a.add(X)
    lease = a.lease(X, 10)
    await a.sync_shared()
    observer = gateways.state("observer")
    assert (await observer.sync({})).remote_load[X].in_flight == 1
    await a.stop()
    assert X not in (await observer.sync({})).remote_load
    lease.release()
