"""A bad KV-event stream never poisons routing (issue 41): every malformed value is a counted
decode error, a subscriber that stops is restarted (its replica approximate meanwhile), ZMQ
messages and queues are bounded, a huge ``dp_size`` is refused and big batches are applied
in slices that let the event loop serve requests."""
from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from gateway.kv_wiring import PreciseMode
from gateway.metrics import GatewayMetrics
from prefix_index.base import ReplicaId
from prefix_index.config import IndexConfig
from prefix_index.precise import EventBlockIndex
from replicas.kv_events import (
    AllBlocksCleared,
    BlockStored,
    EventBatch,
    KvEventError,
    PublisherEndpoint,
    decode_batch,
    encode_batch,
    publishers,
)
from replicas.kv_subscriber import IndexSink, KvEventSubscriber
from tests.kv_events.test_wiring import PAGE, Publisher, request
from tests.kv_events.tokmodel import write_model
from tests.support.procs import free_port

TOPIC = b"kv"
GOOD = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [5, 6, 7, 8],
        "block_size": 2, "lora_id": None, "medium": "GPU"}


def packed(*events: Any, ts: Any = 1.0, rank: Any = 0) -> bytes:
    return msgspec.msgpack.encode([ts, list(events), rank])


# ------------------------------------------------------------------ decoding

@pytest.mark.parametrize("bad", [
    GOOD | {"block_size": "abc"}, GOOD | {"block_size": [1]}, GOOD | {"block_size": -1},
    GOOD | {"block_size": True}, GOOD | {"block_size": 2.5}, GOOD | {"medium": 3}, GOOD | {"medium": ["GPU"]},
    GOOD | {"parent_block_hash": "x"}, GOOD | {"parent_block_hash": 1.5}, GOOD | {"block_hashes": [1, "2"]},
    GOOD | {"block_hashes": [True]}, GOOD | {"block_hashes": None}, GOOD | {"token_ids": ["a"]},
    GOOD | {"token_ids": [[1, 2], 3]}, GOOD | {"token_ids": 7}, {"type": "BlockRemoved", "block_hashes": {}},
    {"type": "BlockRemoved", "block_hashes": [1], "medium": 0}, {"type": 5}, {"nope": 1},
    ["BlockStored", [1], None, [1, 2], "abc"], ["BlockStored", [1], "p", [1, 2], 2],
    ["BlockStored", [1], None, [1, 2], 2, None, 9], ["BlockRemoved", [1], b"GPU"], [], 42, "BlockStored", None,
])
def test_every_malformed_event_is_a_kv_event_error(bad: Any) -> None:
    with pytest.raises(KvEventError):
        decode_batch(0, packed(GOOD, bad))


@pytest.mark.parametrize("payload", [
    packed(GOOD, ts="x"), packed(GOOD, ts=[1]), packed(GOOD, rank="abc"), packed(GOOD, rank=-1),
    packed(GOOD, rank=1.5), msgspec.msgpack.encode([1.0, "events", 0]), msgspec.msgpack.encode({"a": 1}),
    b"\xc1", b"", msgspec.msgpack.encode([1.0, [msgspec.msgpack.Ext(1, b"x")], 0]),
    b"\x91" * 100_000,  # 100k nested arrays
])
def test_every_malformed_batch_is_a_kv_event_error(payload: bytes) -> None:
    with pytest.raises(KvEventError):
        decode_batch(0, payload)


def test_well_formed_shapes_still_decode() -> None:
    batch = decode_batch(3, packed(GOOD, GOOD | {"medium": None, "parent_block_hash": 7, "block_size": None},
                                   ["BlockRemoved", [1]], ["AllBlocksCleared"], ts=None, rank=None))
    assert batch.seq == 3 and batch.ts == 0.0 and batch.dp_rank == 0 and len(batch.events) == 4
    assert batch.events[1] == BlockStored((1, 2), 7, (5, 6, 7, 8), 0, "GPU")


def _mutate(value: Any, rng: random.Random) -> Any:
    """``value`` with one element somewhere replaced by a value of a random type."""
    junk = [None, True, -1, 2**63 - 1, 1.5, "abc", b"\x00", [], {}, [["x"]], {"type": 1}]
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(list(value))
        return value | {key: _mutate(value[key], rng)}
    if isinstance(value, list) and value and rng.random() < 0.8:
        i = rng.randrange(len(value))
        return value[:i] + [_mutate(value[i], rng)] + value[i + 1:]
    return rng.choice(junk)


def test_a_type_fuzzed_batch_raises_nothing_but_kv_event_error() -> None:
    """Any wrong type anywhere in a batch: decoded or refused with KvEventError, never another exception."""
    rng = random.Random(41)
    template = [1.0, [GOOD, {"type": "BlockRemoved", "block_hashes": [3], "medium": "CPU_PINNED"},
                      ["BlockStored", [4], 1, [[1, 2], [3, 4]], 2, None, "GPU"], {"type": "AllBlocksCleared"}], 0]
    for _ in range(3000):
        try:
            decode_batch(0, msgspec.msgpack.encode(_mutate(template, rng)))
        except KvEventError:
            pass


# ------------------------------------------------------------------ discovery bounds

def _info(**kv: Any) -> dict[str, Any]:
    return {"kv_events": {"publisher": "zmq", "endpoint_port_base": 20000, "topic": "kv", "block_size": 4} | kv}


def test_dp_size_above_the_bound_is_refused() -> None:
    assert len(publishers("http://h:1", _info(dp_size=64), max_dp_size=64)) == 64
    with pytest.raises(KvEventError, match="dp_size 200"):
        publishers("http://h:1", _info(dp_size=200), max_dp_size=64)
    with pytest.raises(KvEventError):
        publishers("http://h:1", _info(endpoint_port_base=65530, dp_size=8))
    with pytest.raises(KvEventError):
        publishers("http://h:1", _info(block_size="abc"))
    assert publishers("http://h:1", _info(endpoint_port_base="20000")) == []


async def test_precise_mode_refuses_a_huge_dp_size(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    info = {"model_path": str(write_model(tmp_path / "model")), "startup_time": 1.0} | _info(dp_size=200)

    async def fetch(url: str) -> dict[str, Any]:
        return info

    mode = PreciseMode(IndexConfig(), fetch, metrics=GatewayMetrics())
    try:
        assert not await mode.discover(ReplicaId("http://127.0.0.1:1"))
        assert mode.precise_replicas() == [] and not mode._replicas
        assert "dp_size 200 exceeds" in caplog.text
    finally:
        await mode.close()


# ------------------------------------------------------------------ the subscriber

class Sink:
    def __init__(self, fail_on: int | None = None) -> None:
        self.seqs: list[int] = []
        self.restarts = 0
        self.fail_on = fail_on

    async def apply(self, endpoint: PublisherEndpoint, batch: EventBatch) -> None:
        if batch.seq == self.fail_on:
            self.fail_on = None
            raise RuntimeError("sink broke")
        self.seqs.append(batch.seq)

    async def lost(self, endpoint: PublisherEndpoint, first_missing: int, next_seen: int) -> None:
        pass

    async def restarted(self, endpoint: PublisherEndpoint) -> None:
        self.restarts += 1


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.01)


def valid(seq: int) -> bytes:
    return encode_batch([BlockStored((seq + 100,), None, (1, 2), 2)], ts=float(seq))


async def pub_and_sub(zctx: zmq.asyncio.Context, sink: Sink, **kw: Any) -> tuple[zmq.asyncio.Socket,
                                                                                  KvEventSubscriber,
                                                                                  asyncio.Task[None]]:
    port = free_port()
    pub = zctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    endpoint = PublisherEndpoint("http://127.0.0.1:1", 0, f"tcp://127.0.0.1:{port}", False, TOPIC, 2)
    sub = KvEventSubscriber(endpoint, sink, zctx, **kw)
    task = asyncio.create_task(sub.supervise())
    await until(sub.live.is_set)
    return pub, sub, task


async def send_until(pub: zmq.asyncio.Socket, seq: int, payload: bytes, cond: Callable[[], bool]) -> None:
    """Resend one message until ``cond`` holds (a SUB joining or reconnecting drops what came before)."""
    async with asyncio.timeout(10):
        while not cond():
            await pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])
            await asyncio.sleep(0.02)


async def test_a_bad_batch_is_counted_and_later_batches_are_applied(zctx: zmq.asyncio.Context) -> None:
    sink = Sink()
    pub, sub, task = await pub_and_sub(zctx, sink)
    await send_until(pub, 0, valid(0), lambda: sink.seqs == [0])
    await pub.send_multipart([TOPIC, (1).to_bytes(8, "big"), packed(GOOD | {"block_size": "abc"})])
    await pub.send_multipart([TOPIC, b"short", valid(1)])
    for seq in range(1, 30):
        await pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), valid(seq)])
    await until(lambda: sink.seqs[-1:] == [29])
    assert sink.seqs == list(range(30)) and sub.decode_errors == 2 and sub.restarts == 0 and not task.done()
    task.cancel()


async def test_a_stopped_subscriber_goes_approximate_and_restarts(zctx: zmq.asyncio.Context,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    sink = Sink(fail_on=1)
    stopped: list[str] = []
    pub, sub, task = await pub_and_sub(zctx, sink, on_stopped=stopped.append, restart_backoff_min_s=0.05)
    await send_until(pub, 0, valid(0), lambda: sink.seqs == [0])
    live_when_stopped: list[bool] = []

    def on_stopped(reason: str) -> None:
        stopped.append(reason)
        live_when_stopped.append(sub.live.is_set())

    sub.on_stopped = on_stopped
    await pub.send_multipart([TOPIC, (1).to_bytes(8, "big"), valid(1)])
    await until(lambda: bool(stopped))
    assert live_when_stopped == [False] and "RuntimeError: sink broke" in stopped[0]
    assert sink.restarts == 1  # the replica's entries dropped: a half-applied batch is not trusted
    assert "subscriber stopped (RuntimeError: sink broke)" in caplog.text
    await until(sub.live.is_set)  # restarted: a fresh tracker takes the next batch as the first
    await send_until(pub, 7, valid(7), lambda: sink.seqs[-1:] == [7])
    assert sub.restarts == 1 and not task.done()
    task.cancel()


async def test_restart_backoff_doubles_up_to_its_cap(zctx: zmq.asyncio.Context) -> None:
    delays: list[float] = []

    class Failing(KvEventSubscriber):
        async def run(self) -> None:
            raise zmq.ZMQError(zmq.EADDRINUSE)

        async def _stopped(self, reason: str, delay: float, keep_state: bool = False) -> None:
            delays.append(delay)
            await super()._stopped(reason, delay, keep_state)

    endpoint = PublisherEndpoint("http://127.0.0.1:1", 0, "tcp://127.0.0.1:1", False, TOPIC, 2)
    sub = Failing(endpoint, Sink(), zctx, restart_backoff_min_s=0.01, restart_backoff_max_s=0.04)
    task = asyncio.create_task(sub.supervise())
    await until(lambda: len(delays) >= 5)
    task.cancel()
    assert delays[:5] == [0.01, 0.02, 0.04, 0.04, 0.04] and sub.restarts >= 5


async def test_sockets_bound_message_size_and_queue(zctx: zmq.asyncio.Context) -> None:
    sink = Sink()
    pub, sub, task = await pub_and_sub(zctx, sink, max_message_bytes=4096, receive_hwm=7,
                                       restart_backoff_min_s=0.05)
    assert sub._sock is not None
    assert sub._sock.getsockopt(zmq.MAXMSGSIZE) == 4096 and sub._sock.getsockopt(zmq.RCVHWM) == 7
    await send_until(pub, 0, valid(0), lambda: sink.seqs == [0])
    huge = encode_batch([BlockStored(tuple(range(10_000)), None, (), 2)])
    await pub.send_multipart([TOPIC, (1).to_bytes(8, "big"), huge])  # dropped with the connection
    await send_until(pub, 2, valid(2), lambda: sink.seqs[-1:] == [2])  # ZMQ reconnects on its own
    # ZMQ does not reconnect after a protocol error: the subscriber saw the drop and restarted,
    # keeping its tracker (seq 1 is a gap) and the index (no entries dropped)
    assert 1 not in sink.seqs and sub.restarts == 1 and sink.restarts == 0 and sub.gaps == 1
    assert not task.done()
    task.cancel()


# ------------------------------------------------------------------ bounded slices

async def test_a_huge_batch_is_applied_in_slices() -> None:
    index = EventBlockIndex()
    sink = IndexSink(index, slice_hashes=1000)
    endpoint = PublisherEndpoint("http://127.0.0.1:1", 0, "tcp://127.0.0.1:1", False, TOPIC, 2)
    batch = EventBatch(0, 0.0, 0, (BlockStored(tuple(range(50_000)), None, (), 2),
                                    BlockStored(tuple(range(50_000, 60_000)), None, (), 2, "CPU_PINNED")))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    await sink.apply(endpoint, batch)
    other.cancel()
    assert index.blocks(ReplicaId("http://127.0.0.1:1")) == (50_000, 10_000)
    assert ticks >= 59  # the loop ran other tasks between the 60 slices


# ------------------------------------------------------------------ the wiring

async def test_wiring_counts_restarts_and_stops_trusting_the_replica(zctx: zmq.asyncio.Context,
                                                                      tmp_path: Path) -> None:
    pub = Publisher(zctx, write_model(tmp_path / "model"))
    replica = ReplicaId("http://127.0.0.1:1")

    async def fetch(url: str) -> dict[str, Any]:
        return pub.info()

    metrics = GatewayMetrics()
    mode = PreciseMode(IndexConfig(event_restart_backoff_min_s=0.05), fetch, metrics=metrics)
    try:
        assert await mode.discover(replica)
        async with asyncio.timeout(10):
            while mode.index.blocks(replica) == (0, 0):
                await pub.send([BlockStored((999,), None, (1, 2, 3, 4), PAGE)], seq=0)
                await asyncio.sleep(0.02)
        assert mode.precise_replicas() == [replica]
        await pub.sock.send_multipart([b"kv", (1).to_bytes(8, "big"), packed(GOOD | {"block_size": "abc"})])
        await until(lambda: mode.stream_counts()["decode_errors"] == 1)
        await pub.send([BlockStored((5,), None, (1, 2, 3, 4), PAGE)], seq=2)
        # what the skipped batch changed is unknown: uncertain, routed approximately (not frozen)
        await until(lambda: replica in mode.index.uncertain)
        assert mode.precise_replicas() == [] and await mode.lookup(request(), [replica]) is None
        assert metrics.kv_event_streams.labels("decode_error")._value.get() == 1
        await pub.send([AllBlocksCleared()], seq=3)  # rebuilt: precise again
        await until(lambda: mode.precise_replicas() == [replica])

        sub = mode._replicas[replica].subscribers[0]
        sink = sub.sink

        class Broken:
            async def apply(self, endpoint: PublisherEndpoint, batch: EventBatch) -> None:
                sub.sink = sink
                raise RuntimeError("boom")

        sub.sink = Broken()  # type: ignore[assignment]
        await pub.send([BlockStored((5,), None, (1, 2, 3, 4), PAGE)], seq=4)
        await until(lambda: sub.restarts == 1)
        assert mode.precise_replicas() == [] and mode.index.blocks(replica) == (0, 0)
        assert await mode.lookup(request(), [replica]) is None
        assert metrics.kv_subscriber_restarts.labels(replica)._value.get() == 1
        assert metrics.precise_replicas.labels("precise")._value.get() == 0
        await until(lambda: mode.precise_replicas() == [replica])  # live again after the restart
        async with asyncio.timeout(10):
            while mode.index.blocks(replica) == (0, 0):
                await pub.send([BlockStored((7,), None, (1, 2, 3, 4), PAGE)], seq=0)
                await asyncio.sleep(0.02)
    finally:
        await mode.close()
