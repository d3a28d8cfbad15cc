"""Precise mode's wiring (gateway/kv_wiring.py) over a real ZMQ publisher on loopback, and
the router deciding on its exact matches beside approximate ones (a mixed fleet)."""
from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from gateway.kv_wiring import PreciseAnswer, PreciseMode, attach_precise
from gateway.metrics import GatewayMetrics
from gateway.precise_tokens import ModelTokenizer
from gateway.router import Router
from gateway.sglang_pages import page_hashes
from policies.base import Outcome, RequestContext, SessionKeys
from policies.registry import make_policy
from prefix_index.base import PrefixMatch, ReplicaId
from prefix_index.config import IndexConfig
from prefix_index.memory import MemoryPrefixIndex
from replicas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, Event, encode_batch
from replicas.model import ReplicaState, ReplicaView
from tests.kv_events.tokmodel import write_model
from tests.support.procs import free_port

PAGE = 4
A, B = ReplicaId("http://127.0.0.1:1"), ReplicaId("http://127.0.0.1:2")
PAYLOAD = {"model": "m", "messages": [{"role": "system", "content": "You are a helpful assistant. " * 8},
                                      {"role": "user", "content": "the quick brown fox " * 6}]}


def request(payload: Mapping[str, Any] = PAYLOAD, rid: str = "r1") -> RequestContext:
    return RequestContext(rid, "chat", "m", SessionKeys("s1"), (11, 12, 13), 400, 100, 64, payload=payload)


async def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.01)


class Publisher:
    """A replica's KV-event PUB socket and its /server_info."""

    def __init__(self, ctx: zmq.asyncio.Context, model: Path) -> None:
        self.port = free_port()
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.seq = 0
        self.startup = 1.0
        self.model = model

    def info(self) -> dict[str, Any]:
        return {"model_path": str(self.model), "page_size": PAGE, "speculative_algorithm": None,
                "startup_time": self.startup,
                "kv_events": {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": self.port,
                              "topic": "kv", "block_size": PAGE, "dp_size": 1}}

    async def send(self, events: list[Event], seq: int | None = None) -> None:
        self.seq = self.seq if seq is None else seq
        await self.sock.send_multipart([b"kv", self.seq.to_bytes(8, "big"), encode_batch(events)])
        self.seq += 1


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
async def setup(zctx: zmq.asyncio.Context, tmp_path: Path) -> AsyncIterator[tuple[PreciseMode, Publisher,
                                                                                   GatewayMetrics]]:
    pub = Publisher(zctx, write_model(tmp_path / "model"))
    infos: dict[str, dict[str, Any] | None] = {A: pub.info(), B: {"model_path": "/nowhere", "kv_events": None}}

    async def fetch(url: str) -> dict[str, Any] | None:
        return infos[url]

    metrics = GatewayMetrics()
    mode = PreciseMode(IndexConfig(), fetch, metrics=metrics)
    mode.infos = infos  # type: ignore[attr-defined] - the test changes them
    assert await mode.discover(A) and not await mode.discover(B)
    async with asyncio.timeout(10):  # the SUB joins late: resend the first batch until it is applied
        while mode.index.blocks(A) == (0, 0):
            await pub.send([BlockStored((999,), None, (1, 2, 3, 4), PAGE)], seq=0)
            await asyncio.sleep(0.02)
    yield mode, pub, metrics
    await mode.close()


def prompt_pages(model: Path) -> tuple[int, list[int]]:
    segments = ModelTokenizer.from_dir(model).prompt_segments("chat", PAYLOAD)
    assert segments is not None
    ids = [t for s in segments for t in s.ids]
    return len(ids), page_hashes(ids, PAGE)[:(len(ids) - 1) // PAGE]


async def test_lookup_follows_the_events_per_medium(setup: tuple[PreciseMode, Publisher, GatewayMetrics]) -> None:
    mode, pub, metrics = setup
    tokens, hashes = prompt_pages(pub.model)
    k = len(hashes) - 2
    await pub.send([BlockStored(tuple(hashes[:k]), None, (), PAGE)])
    await until(lambda: mode.index.blocks(A)[0] == k + 1)
    answer = await mode.lookup(request(), [A, B])
    assert answer == PreciseAnswer(tokens, {A: PrefixMatch(k * PAGE, 0)})  # B publishes nothing: not precise
    # HiCache: backed up to the host, then evicted from the GPU: a host hit, not a miss
    await pub.send([BlockStored(tuple(hashes[:k]), None, (), PAGE, "CPU_PINNED"),
                    BlockRemoved(tuple(hashes[2:k]), "GPU")])
    await until(lambda: mode.index.blocks(A) == (3, k))
    assert await mode.lookup(request(), [A])== PreciseAnswer(tokens, {A: PrefixMatch(2 * PAGE, (k - 2) * PAGE)})
    await pub.send([AllBlocksCleared()])  # /flush_cache: the very next request is a miss
    await until(lambda: mode.index.blocks(A) == (0, 0))
    assert await mode.lookup(request(), [A]) == PreciseAnswer(tokens, {A: PrefixMatch()})
    assert metrics.kv_event_streams.labels("cleared")._value.get() == 1


async def test_gap_restart_and_removal(setup: tuple[PreciseMode, Publisher, GatewayMetrics]) -> None:
    mode, pub, metrics = setup
    _, hashes = prompt_pages(pub.model)
    await pub.send([BlockStored(tuple(hashes), None, (), PAGE)], seq=1)
    await pub.send([BlockRemoved((hashes[-1],), "GPU")], seq=5)  # 2..4 lost, no replay advertised
    await until(lambda: A in mode.index.uncertain)
    assert await mode.lookup(request(), [A, B]) is None  # uncertain: routed approximately
    assert metrics.kv_event_streams.labels("gap")._value.get() == 1
    assert metrics.kv_event_streams.labels("lost")._value.get() == 1
    # the replica restarted (a new startup_time, seen when it comes back ACTIVE): entries dropped
    pub.startup = 2.0
    mode.infos[A] = pub.info()  # type: ignore[attr-defined]
    assert await mode.discover(A)
    assert mode.index.blocks(A) == (0, 0) and A not in mode.index.uncertain
    mode.on_removed(A)
    assert A not in mode.index.replicas() and mode.precise_replicas() == []
    assert await mode.lookup(request(), [A]) is None


def view(rid: ReplicaId) -> ReplicaView:
    return ReplicaView(rid, ReplicaState.ACTIVE, device_tokens=100_000, page_size=PAGE)


class FakePrecise:
    def __init__(self, answer: PreciseAnswer | None) -> None:
        self.answer = answer

        self.asked: list[list[ReplicaId]] = []

    async def lookup(self, ctx: RequestContext, replicas: Sequence[ReplicaId]) -> PreciseAnswer | None:
        self.asked.append(list(replicas))
        return self.answer


async def test_router_predicts_exact_tokens_in_a_mixed_fleet() -> None:
    index = MemoryPrefixIndex()
    await index.record(B, (11, 12, 13))  # the approximate index: B holds 3 blocks of 64 tokens
    metrics = GatewayMetrics()
    router = Router(make_policy("cache-aware", seed=1), index, lambda: (view(A), view(B)), metrics,
                    rng=random.Random(1))
    router.precise = FakePrecise(PreciseAnswer(437, {A: PrefixMatch(300, 20)}))
    ctx = request()
    inputs = await router.snapshot(ctx)
    assert inputs.matches == {A: PrefixMatch(300, 20), B: PrefixMatch(192, 0)}  # both in tokens
    decision = router.decide(ctx, inputs)
    assert decision.replica == A and decision.predicted_cached_tokens == 320
    await router.routed(ctx, decision)
    await router.completed(ctx, decision, Outcome(True, 200, prompt_tokens=437, cached_tokens=318))
    exposition = metrics.exposition().decode()
    assert 'kvgate_prediction_error_tokens_count{mode="precise"} 1.0' in exposition
    # without an answer (not tokenizable, or no replica with events) the approximate units stay
    router.precise = FakePrecise(None)
    ctx2 = request(rid="r2")
    assert (await router.snapshot(ctx2)).matches[B] == PrefixMatch(3, 0)


async def test_a_request_is_tokenized_only_for_the_replicas_serving_its_model() -> None:
    """Two models behind one gateway: a request for "m" is never tokenized with the other
    model's tokenizer (its replicas are not asked), one naming no model asks every replica."""
    a, b = dataclasses.replace(view(A), models=frozenset({"m"})), dataclasses.replace(view(B), models=frozenset({"n"}))
    router = Router(make_policy("cache-aware", seed=1), MemoryPrefixIndex(), lambda: (a, b), GatewayMetrics(),
                    rng=random.Random(1))
    fake = FakePrecise(None)
    router.precise = fake
    await router.snapshot(request())
    await router.snapshot(dataclasses.replace(request(rid="r2"), model="n"))
    await router.snapshot(dataclasses.replace(request(rid="r3"), model="default"))
    assert fake.asked == [[A], [B], [A, B]]


def test_approximate_mode_attaches_nothing() -> None:
    assert attach_precise(IndexConfig(mode="approximate"), None, None, None, None) is None  # type: ignore[arg-type]


async def test_a_bound_subscriber_survives_rediscovery(zctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    """A concrete publisher host (the publisher connects, we bind): after a restart is seen in
    /server_info the new subscriber re-binds the same address and events flow again."""
    port = free_port()
    info: dict[str, Any] = {"model_path": str(write_model(tmp_path / "model")), "startup_time": 1.0,
                            "kv_events": {"publisher": "zmq", "endpoint_host": "127.0.0.1", "endpoint_port_base": port,
                                          "topic": "kv", "block_size": PAGE, "dp_size": 1}}

    async def fetch(url: str) -> dict[str, Any]:
        return info

    mode = PreciseMode(IndexConfig(), fetch)
    pub = zctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(f"tcp://127.0.0.1:{port}")
    try:
        for startup, block in ((1.0, 7), (2.0, 8)):
            info["startup_time"] = startup
            assert await mode.discover(A)
            async with asyncio.timeout(10):
                while mode.index.blocks(A)[0] == 0:
                    await pub.send_multipart([b"kv", (0).to_bytes(8, "big"),
                                              encode_batch([BlockStored((block,), None, (), PAGE)])])
                    await asyncio.sleep(0.02)
            assert mode.index.blocks(A) == (1, 0)  # the restart dropped the first life's page
    finally:
        pub.close()
        await mode.close()
