"""One replica DP rank's KV-event stream: subscribe, decode, detect gaps, heal, hand over.

``KvEventSubscriber.run()`` is a task of its own (owned by whoever starts it, cancelled
on shutdown); it never touches the request path: decoded batches go to an
``EventSink`` (the precise index), in sequence order. Per message
(``replicas.kv_events``):

    first / next seq      -> sink.apply(batch)
    a gap (seq jumped)    -> replay the missing batches from the publisher's ROUTER
                             (when advertised, within replay_timeout_s) and apply them first;
                             what could not be replayed -> sink.lost(...): the replica's entries
                             are uncertain until rebuilt
    seq back to 0         -> sink.restarted(...) (the replica restarted: drop its entries), apply
    an old seq            -> ignored (a duplicate)
    undecodable           -> counted in ``decode_errors``, skipped

A publisher with a wildcard host binds and we connect; with a concrete host it connects
and we bind (``PublisherEndpoint.bind``).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import zmq
import zmq.asyncio

from prefix_index.base import ReplicaId
from prefix_index.precise import EventBlockIndex
from replicas.kv_events import (
    REPLAY_END,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEventError,
    PublisherEndpoint,
    SeqStatus,
    SequenceTracker,
    decode_batch,
    decode_message,
    decode_seq,
)

log = logging.getLogger("replicas.kv_events")


class EventSink(Protocol):
    async def apply(self, endpoint: PublisherEndpoint, batch: EventBatch) -> None: ...

    async def lost(self, endpoint: PublisherEndpoint, first_missing: int, next_seen: int) -> None: ...

    async def restarted(self, endpoint: PublisherEndpoint) -> None: ...


class KvEventSubscriber:
    def __init__(self, endpoint: PublisherEndpoint, sink: EventSink, context: zmq.asyncio.Context, *,
                 replay_timeout_s: float = 1.0) -> None:
        self.endpoint = endpoint
        self.sink = sink
        self.context = context
        self.replay_timeout_s = replay_timeout_s
        self.tracker = SequenceTracker()
        self.applied = 0
        self.gaps = 0
        self.healed = 0
        self.decode_errors = 0

    def _socket(self) -> zmq.asyncio.Socket:
        sock = self.context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.endpoint.topic)
        if self.endpoint.bind:
            sock.bind(self.endpoint.endpoint)
        else:
            sock.connect(self.endpoint.endpoint)
        return sock

    async def run(self) -> None:
        sock = self._socket()
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    batch = decode_message(frames)
                except KvEventError as exc:
                    self.decode_errors += 1
                    log.warning("kv events from %s: %s", self.endpoint.endpoint, exc)
                    continue
                await self.handle(batch)
        finally:
            sock.close(linger=0)

    async def handle(self, batch: EventBatch) -> None:
        status, first_missing = self.tracker.observe(batch.seq)
        if status is SeqStatus.OLD:
            return
        if status is SeqStatus.RESTART:
            await self.sink.restarted(self.endpoint)
        elif status is SeqStatus.GAP:
            self.gaps += 1
            await self._heal(first_missing, batch.seq)
        await self.sink.apply(self.endpoint, batch)
        self.applied += 1

    async def _heal(self, first_missing: int, next_seen: int) -> None:
        replayed = await self.replay(first_missing, next_seen) if self.endpoint.replay_endpoint else []
        expected = first_missing
        for batch in replayed:
            if batch.seq != expected:
                break
            await self.sink.apply(self.endpoint, batch)
            expected += 1
        if expected < next_seen:
            log.warning("kv events from %s: batches %d..%d lost; entries uncertain", self.endpoint.endpoint,
                        expected, next_seen - 1)
            await self.sink.lost(self.endpoint, expected, next_seen)
        else:
            self.healed += 1

    async def replay(self, start: int, stop: int) -> list[EventBatch]:
        """Batches ``start <= seq < stop`` from the replay socket ([] on timeout or error)."""
        assert self.endpoint.replay_endpoint is not None
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint.replay_endpoint)
        out: list[EventBatch] = []
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(self.replay_timeout_s):
                while True:
                    frames = await sock.recv_multipart()
                    if len(frames) != 4:
                        raise KvEventError(f"replay reply has {len(frames)} frames")
                    seq = decode_seq(frames[2], signed=True)
                    if seq == REPLAY_END:
                        break
                    if start <= seq < stop:
                        out.append(decode_batch(seq, frames[3]))
        except (TimeoutError, KvEventError, zmq.ZMQError) as exc:
            log.warning("kv events replay from %s failed: %s", self.endpoint.replay_endpoint, exc)
        finally:
            sock.close(linger=0)
        return sorted(out, key=lambda b: b.seq)


class IndexSink:
    """Applies a replica's events to the precise index (``prefix_index.precise``)."""

    def __init__(self, index: EventBlockIndex) -> None:
        self.index = index
        self.events = 0

    async def apply(self, endpoint: PublisherEndpoint, batch: EventBatch) -> None:
        replica = ReplicaId(endpoint.replica)
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.index.stored(replica, event.block_hashes, event.medium)
            elif isinstance(event, BlockRemoved):
                self.index.removed(replica, event.block_hashes, event.medium)
            elif isinstance(event, AllBlocksCleared):
                self.index.cleared(replica)
        self.events += len(batch.events)

    async def lost(self, endpoint: PublisherEndpoint, first_missing: int, next_seen: int) -> None:
        self.index.uncertain.add(ReplicaId(endpoint.replica))

    async def restarted(self, endpoint: PublisherEndpoint) -> None:
        self.index.cleared(ReplicaId(endpoint.replica))
