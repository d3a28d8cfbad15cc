"""The simulated replica publishes SGLang 0.5.23's KV events, decoded by the gateway's code.

One real ``kvgate sim`` process (tiny profile: 16-token pages, a 4096-token device pool,
an 8192-token host pool) started with ``--kv-events-config``; a ZMQ SUB socket found
through ``/server_info.kv_events`` (``replicas.kv_events.publishers``) decodes every
message with ``replicas.kv_events.decode_message``. Checked: the page hashes are
``gateway.sglang_pages.page_hashes`` of the prompt's token ids; stored / removed per
medium (GPU, CPU_PINNED) keep an ``EventBlockIndex`` equal to what the replica reports
(every request's ``cached_tokens`` is the index's prediction); ``AllBlocksCleared`` on
/flush_cache; sequence numbers from 0 without holes; a gap is healed from the replay
socket by the gateway's ``KvEventSubscriber``.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import zmq
import zmq.asyncio

from gateway.sglang_pages import page_hashes
from loadtest.simulator import tokenizer
from loadtest.simulator.fleet import SimFleet
from loadtest.simulator.kv_publisher import KvEventsConfig, descriptor
from loadtest.simulator.ports import free_port
from prefix_index.base import ReplicaId
from prefix_index.precise import EventBlockIndex
from replicas.kv_events import (
    CPU_PINNED,
    GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    PublisherEndpoint,
    decode_message,
    publishers,
)
from replicas.kv_subscriber import IndexSink, KvEventSubscriber

PAGE = 16  # the tiny profile's page size
QUIET_S = 0.4


class Replica:
    """The replica process, its decoded event stream and an index fed from it."""

    def __init__(self, fleet: SimFleet, i: int = 0) -> None:
        self.url = fleet.urls[i]
        self.http = httpx.Client(base_url=self.url, timeout=20.0, trust_env=False)
        self.info = self.http.get("/server_info").json()
        self.endpoint = publishers(self.url, self.info)[0]
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.endpoint.topic)
        monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sub.connect(self.endpoint.endpoint)
        # ZMQ's slow joiner: nothing reaches the SUB before the handshake; the subscription
        # follows it on the same connection, well before the first request's events
        assert monitor.poll(20_000), "no handshake with the replica's publisher"
        monitor.recv_multipart()
        self.sub.disable_monitor()
        monitor.close(linger=0)
        time.sleep(0.05)
        self.batches: list[EventBatch] = []
        self.index = EventBlockIndex()
        self.rid = ReplicaId(self.url)

    def drain(self, timeout_s: float = 10.0) -> list[EventBatch]:
        """Every batch received until the stream is quiet for ``QUIET_S``."""
        got: list[EventBatch] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.sub.poll(int(QUIET_S * 1000)):
            got.append(decode_message(self.sub.recv_multipart()))
        for batch in got:
            for e in batch.events:
                if isinstance(e, BlockStored):
                    self.index.stored(self.rid, e.block_hashes, e.medium)
                elif isinstance(e, BlockRemoved):
                    self.index.removed(self.rid, e.block_hashes, e.medium)
                else:
                    self.index.cleared(self.rid)
        self.batches += got
        return got

    def chat(self, text: str) -> tuple[list[int], dict[str, Any]]:
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.encode(tokenizer.render_chat(messages)).tolist()
        r = self.http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 4})
        r.raise_for_status()
        return ids, r.json()

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()
        self.http.close()


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    port, replay = free_port(), free_port()
    config = {"publisher": "zmq", "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay}",
              "topic": "kv"}
    log_dir: Path = tmp_path_factory.mktemp("kv-replica")
    with SimFleet(1, profile="tiny", time_scale=20.0, seed=5, log_dir=log_dir,
                  extra_args=("--kv-events-config", orjson.dumps(config).decode())) as fleet:
        rep = Replica(fleet)
        try:
            yield rep
        finally:
            rep.close()


def events(batches: list[EventBatch]) -> list[Any]:
    return [e for b in batches for e in b.events]


def text(i: int, chars: int = 3900) -> str:
    return (f"prompt {i:03d} " + "lorem ipsum dolor sit amet " * 200)[:chars]


def test_descriptor_and_config() -> None:
    cfg = KvEventsConfig.from_json('{"enable_kv_cache_events": true}')  # vLLM's flag: dropped
    assert not cfg.enabled and descriptor(cfg, 16) is None
    ipc = KvEventsConfig.from_json('{"publisher": "zmq", "endpoint": "ipc:///tmp/x"}')
    assert descriptor(ipc, 16) is None


def test_discovery(replica: Replica) -> None:
    kv = replica.info["kv_events"]
    assert kv["publisher"] == "zmq" and kv["endpoint_host"] == "*" and kv["topic"] == "kv"
    assert kv["block_size"] == PAGE and kv["dp_size"] == 1 and kv["replay_endpoint_port_base"] > 0
    assert replica.endpoint.endpoint.startswith("tcp://127.0.0.1:") and not replica.endpoint.bind


def test_stored_hashes_are_sglang_page_hashes(replica: Replica) -> None:
    ids, body = replica.chat(text(0))
    assert body["usage"]["prompt_tokens"] == len(ids)
    stored = [e for e in events(replica.drain()) if isinstance(e, BlockStored)]
    assert stored and all(e.medium == GPU and e.block_size == PAGE for e in stored)
    assert stored[0].parent_block_hash is None
    hashes = [h for e in stored for h in e.block_hashes]
    tokens = [t for e in stored for t in e.token_ids]
    prompt_pages = page_hashes(ids, PAGE)
    assert hashes[: len(prompt_pages)] == prompt_pages
    assert tokens[: len(prompt_pages) * PAGE] == ids[: len(prompt_pages) * PAGE]
    for e in stored:  # chained: each event's parent is the page before its first block
        assert len(e.token_ids) == len(e.block_hashes) * PAGE
        if e.parent_block_hash is not None:
            assert hashes[hashes.index(e.block_hashes[0]) - 1] == e.parent_block_hash


def test_media_follow_eviction_and_load_back(replica: Replica) -> None:
    """14 distinct ~1000-token prompts overflow device (256 pages) and host (512 pages);
    then prompts still on the host come back. Every request's reported cached_tokens
    equals the prediction of the index fed by the events before it."""
    host_hits = 0
    for i in [*range(1, 15), 8, 9, 13, 3, 1]:
        ids = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": text(i)}])).tolist()
        match = replica.index.match(page_hashes(ids, PAGE), [replica.rid])[replica.rid]
        predicted = min(match.blocks, (len(ids) - 1) // PAGE) * PAGE
        host_hits += match.host_blocks > 0
        _, body = replica.chat(text(i))
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted, i
        replica.drain()
    kinds = {(type(e).__name__, getattr(e, "medium", None)) for e in events(replica.batches)}
    assert {("BlockStored", GPU), ("BlockRemoved", GPU), ("BlockStored", CPU_PINNED),
            ("BlockRemoved", CPU_PINNED)} <= kinds
    assert host_hits > 0
    device, host = replica.index.blocks(replica.rid)
    assert device <= 4096 // PAGE and host <= 8192 // PAGE


def test_flush_cache_clears(replica: Replica) -> None:
    replica.chat(text(20))
    replica.drain()
    assert replica.http.post("/flush_cache").status_code == 200
    got = events(replica.drain())
    assert got and isinstance(got[-1], AllBlocksCleared)
    assert replica.index.blocks(replica.rid) == (0, 0)
    _, body = replica.chat(text(20))
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_sequence_numbers_and_replay_heal_a_gap(replica: Replica) -> None:
    replica.chat(text(30))
    replica.drain()
    seqs = [b.seq for b in replica.batches]
    assert seqs == list(range(len(seqs)))  # from 0, no hole (this SUB joined before any event)
    assert all(b.dp_rank == 0 for b in replica.batches)

    class Sink:
        def __init__(self) -> None:
            self.applied: list[int] = []
            self.losses: list[tuple[int, int]] = []

        async def apply(self, endpoint: PublisherEndpoint, batch: EventBatch) -> None:
            self.applied.append(batch.seq)

        async def lost(self, endpoint: PublisherEndpoint, first_missing: int, next_seen: int) -> None:
            self.losses.append((first_missing, next_seen))

        async def restarted(self, endpoint: PublisherEndpoint) -> None:
            raise AssertionError("no restart")

    async def heal() -> tuple[Sink, KvEventSubscriber]:
        sink = Sink()
        sub = KvEventSubscriber(replica.endpoint, sink, zmq.asyncio.Context(), replay_timeout_s=5.0)
        await sub.handle(replica.batches[0])
        await sub.handle(replica.batches[4])  # 1..3 lost: replayed from the ROUTER
        return sink, sub

    sink, sub = asyncio.run(heal())
    assert sink.applied == [0, 1, 2, 3, 4] and not sink.losses and sub.gaps == 1 and sub.healed == 1


def test_index_sink_applies_the_stream(replica: Replica) -> None:
    """The gateway's own sink, fed the decoded stream, ends where the local index is."""
    index = EventBlockIndex()
    sink = IndexSink(index)
    endpoint = replica.endpoint

    async def feed() -> None:
        for batch in replica.batches:
            await sink.apply(endpoint, batch)

    asyncio.run(feed())
    assert index.blocks(ReplicaId(endpoint.replica)) == replica.index.blocks(replica.rid)


def test_port_zero_gives_each_replica_of_a_fleet_its_own_publisher(tmp_path: Path) -> None:
    config = '{"publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}'
    with SimFleet(2, profile="tiny", time_scale=20.0, seed=9, log_dir=tmp_path,
                  extra_args=("--kv-events-config", config)) as fleet:
        reps = [Replica(fleet, i) for i in range(2)]
        try:
            ports = {r.info["kv_events"]["endpoint_port_base"] for r in reps}
            ports |= {r.info["kv_events"]["replay_endpoint_port_base"] for r in reps}
            assert len(ports) == 4 and 0 not in ports
            for r in reps:
                ids, _ = r.chat(text(40))
                stored = [e for e in events(r.drain()) if isinstance(e, BlockStored)]
                assert [h for e in stored for h in e.block_hashes][: len(ids) // PAGE] == page_hashes(ids, PAGE)
        finally:
            for r in reps:
                r.close()
