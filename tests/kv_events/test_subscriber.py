"""The KV-event subscriber over real ZMQ sockets on loopback: order, gaps, replay, restarts."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from replicas import kv_subscriber
from replicas.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    PublisherEndpoint,
    decode_message,
    encode_batch,
    publishers,
)
from replicas.kv_subscriber import KvEventSubscriber
from tests.support.procs import free_port

TOPIC = b"kv"


class Sink:
    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.lost_ranges: list[tuple[int, int]] = []
        self.restarts = 0
        self.got = asyncio.Event()

    async def apply(self, endpoint: PublisherEndpoint, batch: EventBatch) -> None:
        self.seqs.append(batch.seq)
        self.got.set()

    async def lost(self, endpoint: PublisherEndpoint, first_missing: int, next_seen: int) -> None:
        self.lost_ranges.append((first_missing, next_seen))

    async def restarted(self, endpoint: PublisherEndpoint) -> None:
        self.restarts += 1


def payload(seq: int) -> bytes:
    return encode_batch([BlockStored((seq * 10 + 1,), None, (1, 2), 2, "GPU")], ts=float(seq))


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def connected(pub: zmq.asyncio.Socket, sink: Sink) -> None:
    """Publish seq 0 until the subscriber has it (ZMQ drops messages before the subscription joins)."""
    async with asyncio.timeout(10):
        while not sink.got.is_set():
            await pub.send_multipart([TOPIC, (0).to_bytes(8, "big"), payload(0)])
            await asyncio.sleep(0.02)


async def wait_for(cond: object, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0.01)


async def start(ctx: zmq.asyncio.Context, replay_port: int | None) -> tuple[zmq.asyncio.Socket, Sink,
                                                                             KvEventSubscriber, asyncio.Task[None]]:
    port = free_port()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    endpoint = PublisherEndpoint("http://127.0.0.1:1", 0, f"tcp://127.0.0.1:{port}", False, TOPIC, 2,
                                 f"tcp://127.0.0.1:{replay_port}" if replay_port else None)
    sink = Sink()
    sub = KvEventSubscriber(endpoint, sink, ctx, replay_timeout_s=1.0)
    task = asyncio.create_task(sub.run())
    await connected(pub, sink)
    return pub, sink, sub, task


async def send(pub: zmq.asyncio.Socket, seq: int) -> None:
    await pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload(seq)])


async def test_in_order_and_duplicates(ctx: zmq.asyncio.Context) -> None:
    pub, sink, _sub, task = await start(ctx, None)
    for seq in (1, 2, 2, 3):
        await send(pub, seq)
    await wait_for(lambda: sink.seqs[-1:] == [3])
    assert sink.seqs == [0, 1, 2, 3] and not sink.lost_ranges
    task.cancel()
    pub.close()


async def test_gap_without_replay_marks_lost(ctx: zmq.asyncio.Context) -> None:
    pub, sink, sub, task = await start(ctx, None)
    await send(pub, 1)
    await send(pub, 4)
    await wait_for(lambda: sink.seqs[-1:] == [4])
    assert sink.lost_ranges == [(2, 4)] and sub.gaps == 1
    task.cancel()
    pub.close()


async def replay_server(ctx: zmq.asyncio.Context, port: int, buffered: dict[int, bytes]) -> None:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{port}")
    try:
        while True:
            ident, _empty, start_frame = await router.recv_multipart()
            start = int.from_bytes(start_frame, "big")
            for seq in sorted(s for s in buffered if s >= start):
                await router.send_multipart([ident, b"", TOPIC, seq.to_bytes(8, "big"), buffered[seq]])
            await router.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
    finally:
        router.close()


async def test_gap_healed_by_replay(ctx: zmq.asyncio.Context) -> None:
    replay_port = free_port()
    buffered: dict[int, bytes] = {}  # empty when the subscriber joins: nothing to sync
    server = asyncio.create_task(replay_server(ctx, replay_port, buffered))
    pub, sink, sub, task = await start(ctx, replay_port)
    assert sub.live.is_set() and sub.synced == 0
    buffered.update({s: payload(s) for s in range(10)})
    await send(pub, 1)
    await send(pub, 5)  # 2, 3, 4 lost on the PUB socket, still in the replay buffer
    await wait_for(lambda: sink.seqs[-1:] == [5])
    assert sink.seqs == [0, 1, 2, 3, 4, 5] and not sink.lost_ranges and sub.healed == 1
    task.cancel()
    server.cancel()
    pub.close()


async def test_joining_syncs_from_the_replay_buffer(ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """What the publisher sent before the subscriber connected (ZMQ dropped it) is replayed on
    joining, before the stream is live; live batches the replay covered are duplicates. A
    stream not joined in ``JOIN_WARN_S`` is logged."""
    monkeypatch.setattr(kv_subscriber, "JOIN_WARN_S", 0.1)
    port, replay_port = free_port(), free_port()
    buffered = {s: payload(s) for s in range(3)}
    server = asyncio.create_task(replay_server(ctx, replay_port, buffered))
    endpoint = PublisherEndpoint("http://127.0.0.1:1", 0, f"tcp://127.0.0.1:{port}", False, TOPIC, 2,
                                 f"tcp://127.0.0.1:{replay_port}")
    sink = Sink()
    lives: list[list[int]] = []
    sub = KvEventSubscriber(endpoint, sink, ctx, replay_timeout_s=1.0, on_live=lambda: lives.append(list(sink.seqs)))
    task = asyncio.create_task(sub.run())
    await asyncio.sleep(0.3)  # no publisher yet: the stream cannot be live, nothing was applied
    assert not sub.live.is_set() and sink.seqs == []
    assert [r for r in caplog.records if "no publisher connected after" in r.getMessage()]
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    await asyncio.wait_for(sub.live.wait(), 10)
    assert lives == [[0, 1, 2]] and sub.synced == 3
    async with asyncio.timeout(10):  # live batches: 1 and 2 again (covered by the replay), then 3
        while sink.seqs[-1] != 3:
            for seq in (1, 2, 3):
                await send(pub, seq)
            await asyncio.sleep(0.02)
    await send(pub, 0)  # beyond the replayed range, going back is a restart again
    await wait_for(lambda: sink.restarts == 1)
    assert sink.seqs[:4] == [0, 1, 2, 3] and set(sink.seqs[4:-1]) <= {3} and sink.seqs[-1] == 0
    task.cancel()
    server.cancel()
    pub.close()


async def test_joining_after_a_lease_takeover_replays_only_what_follows(ctx: zmq.asyncio.Context) -> None:
    """A gateway taking over a replica's lease has applied the relayed batches (the tracker
    expects 3): the join replays from there, and the older buffered batches are no restart."""
    port, replay_port = free_port(), free_port()
    server = asyncio.create_task(replay_server(ctx, replay_port, {s: payload(s) for s in range(6)}))
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    endpoint = PublisherEndpoint("http://127.0.0.1:1", 0, f"tcp://127.0.0.1:{port}", False, TOPIC, 2,
                                 f"tcp://127.0.0.1:{replay_port}")
    sink = Sink()
    sub = KvEventSubscriber(endpoint, sink, ctx, replay_timeout_s=1.0)
    sub.tracker.expected = 3
    task = asyncio.create_task(sub.run())
    await asyncio.wait_for(sub.live.wait(), 10)
    assert sink.seqs == [3, 4, 5] and sink.restarts == 0 and sub.synced == 3
    task.cancel()
    server.cancel()
    pub.close()


async def test_a_restart_seen_late_replays_the_new_runs_first_batches(ctx: zmq.asyncio.Context) -> None:
    """The replica restarted and its publisher reconnected after sending batches 0 and 1 of
    its new run: they come from the replay buffer (without one, the replica is uncertain)."""
    replay_port = free_port()
    buffered: dict[int, bytes] = {}
    server = asyncio.create_task(replay_server(ctx, replay_port, buffered))
    pub, sink, sub, task = await start(ctx, replay_port)
    for seq in (1, 2, 3):
        await send(pub, seq)
    await wait_for(lambda: sink.seqs[-1:] == [3])
    buffered.update({s: payload(s) for s in range(3)})  # the new run: 0, 1 missed live
    await send(pub, 2)
    await wait_for(lambda: sink.restarts == 1 and sink.seqs[-1:] == [2])
    assert sink.seqs[-3:] == [0, 1, 2] and not sink.lost_ranges and sub.healed == 1
    task.cancel()
    server.cancel()
    pub.close()
    pub, sink, sub, task = await start(ctx, None)
    for seq in (1, 2, 3, 2):
        await send(pub, seq)
    await wait_for(lambda: sink.restarts == 1)
    await wait_for(lambda: sink.lost_ranges == [(0, 2)])
    task.cancel()
    pub.close()


async def test_restart_and_garbage(ctx: zmq.asyncio.Context) -> None:
    pub, sink, sub, task = await start(ctx, None)
    await send(pub, 1)
    await pub.send_multipart([TOPIC, b"\x00" * 8, b"\xc1not msgpack"])
    await send(pub, 0)  # the replica restarted: its publisher counts from 0 again
    await wait_for(lambda: sink.restarts == 1)
    assert sub.decode_errors == 1 and sink.seqs[-1] == 0
    task.cancel()
    pub.close()


def test_decode_both_shapes_and_discovery() -> None:
    new = encode_batch([BlockStored((1, 2), None, (5, 6, 7, 8), 2, "CPU_PINNED"), BlockRemoved((9,), "GPU"),
                        AllBlocksCleared()], ts=1.5, dp_rank=3)
    batch = decode_message([b"", (7).to_bytes(8, "big"), new])
    assert batch.seq == 7 and batch.dp_rank == 3 and batch.events[0] == BlockStored((1, 2), None, (5, 6, 7, 8),
                                                                                   2, "CPU_PINNED")
    import msgspec
    old = msgspec.msgpack.encode([1.0, [["BlockStored", [4], 3, [1, 2], 2, None], ["BlockRemoved", [4]],
                                        ["AllBlocksCleared"]]])
    events = decode_message([b"", (0).to_bytes(8, "big"), old]).events
    assert events == (BlockStored((4,), 3, (1, 2), 2, "GPU"), BlockRemoved((4,), "GPU"), AllBlocksCleared())
    info = {"kv_events": {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": "kv",
                          "block_size": 64, "dp_size": 2, "replay_endpoint_port_base": 5600}}
    eps = publishers("http://10.1.2.3:30000/", info)
    assert [e.endpoint for e in eps] == ["tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558"]
    assert not eps[0].bind and eps[1].replay_endpoint == "tcp://10.1.2.3:5601" and eps[0].block_size == 64
    concrete = publishers("http://127.0.0.1:1", {"kv_events": {"publisher": "zmq", "endpoint_host": "127.0.0.1",
                                                             "endpoint_port_base": 7000}})
    assert concrete[0].bind and concrete[0].endpoint == "tcp://127.0.0.1:7000"
    assert publishers("http://h:1", {"kv_events": None}) == []


async def test_index_sink_applies_per_medium() -> None:
    from prefix_index.base import PrefixMatch, ReplicaId
    from prefix_index.precise import EventBlockIndex
    from replicas.kv_subscriber import IndexSink

    index = EventBlockIndex()
    sink = IndexSink(index)
    ep = PublisherEndpoint("http://127.0.0.1:1", 0, "tcp://127.0.0.1:2", False, TOPIC, 2)
    rid = ReplicaId("http://127.0.0.1:1")
    await sink.apply(ep, EventBatch(0, 0.0, 0, (BlockStored((1, 2), None, (1, 2, 3, 4), 2, "GPU"),
                                               BlockStored((1, 2), None, (1, 2, 3, 4), 2, "CPU_PINNED"),
                                               BlockRemoved((2,), "GPU"))))
    assert index.match([1, 2], [rid])[rid] == PrefixMatch(1, 1)
    await sink.lost(ep, 3, 5)
    assert rid in index.uncertain
    await sink.apply(ep, EventBatch(1, 0.0, 0, (AllBlocksCleared(),)))
    assert index.match([1, 2], [rid])[rid] == PrefixMatch() and rid not in index.uncertain
