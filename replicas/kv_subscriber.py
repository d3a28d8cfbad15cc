"""One replica DP rank's KV-event stream: subscribe, decode, detect gaps, heal, hand over.

``KvEventSubscriber.run()`` is a task of its own (owned by whoever starts it, cancelled
on shutdown); it never touches the request path: decoded batches go to an
``EventSink`` (the precise index), in sequence order.

Joining: ZMQ drops what a PUB socket sends before the subscriber is connected (the
"slow joiner": a replica's publisher reconnects every 100 ms, so a request served right
after the gateway subscribed published into the void, and nothing showed it). So the
stream is ``live`` (``live``, ``on_live``) only once the ZMTP handshake with the
publisher succeeded (a socket monitor) and, when the publisher advertises a replay
socket, once its whole buffer (SGLang keeps the last ``buffer_steps`` = 10,000 batches)
was replayed and applied: what the replica stored before the handshake is then known.
A batch lost between the handshake and the subscription reaching the publisher shows as
a gap at the next batch and is replayed. Live messages the replay already covered are
duplicates (``SequenceTracker.synced_through``), not a restart.

Per message (``replicas.kv_events``):

    first / next seq      -> sink.apply(batch)
    a gap (seq jumped)    -> replay the missing batches from the publisher's ROUTER
                             (when advertised, within replay_timeout_s) and apply them first;
                             what could not be replayed -> sink.lost(...): the replica's entries
                             are uncertain until rebuilt
    seq went back         -> sink.restarted(...) (the replica restarted: drop its entries);
                             its batches before this one replayed as for a gap; apply
    the last seq again    -> ignored (a duplicate)
    undecodable           -> counted in ``decode_errors``, skipped (any malformed value:
                             the decoder raises nothing but ``KvEventError``); its seq
                             is then missing, a gap at the next batch
    connection dropped    -> ``StreamDropped``: not live, rejoined by ``supervise()``

A hostile or broken stream can neither kill nor stall this consumer: messages are bounded
in size (``ZMQ_MAXMSGSIZE``) and in number queued (``ZMQ_RCVHWM``); ``supervise()`` runs
``run()`` again, with capped exponential backoff, after it stopped for any reason, clearing
``live`` at once so the replica is routed approximately meanwhile (a frozen index never
passes for a precise one); and ``IndexSink`` applies a batch in slices, yielding to the event
loop between them, and decoding and applying together take at most ``EVENT_LOOP_SHARE`` of
the loop's time (``LoopShare``), so requests keep being served whatever the event rate.

A publisher with a wildcard host binds and we connect; with a concrete host it connects
and we bind (``PublisherEndpoint.bind``).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Generator
from typing import Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

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
    decode_seq,
    decode_steps,
    encode_batch,
    message_steps,
)
from replicas.loop_share import LoopShare

log = logging.getLogger("replicas.kv_events")
BIND_RETRY_S = 5.0
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # defaults of ``IndexConfig.event_max_message_bytes`` etc.
RECEIVE_HWM_MESSAGES = 256
APPLY_SLICE_HASHES = 4096
RESTART_BACKOFF_MIN_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0
JOIN_WARN_S = 30.0  # a stream not joined by then is logged (once): a publisher the gateway cannot reach
ALL_BUFFERED = (1 << 63) - 1  # replay's exclusive upper bound: every buffered batch
JOIN_REPLAY_TIMEOUT_S = 30.0
"""The whole buffer on joining (up to 10,000 batches, first turns' token ids included: tens
of MB on a busy replica) may take longer than a gap's replay; the replica is routed
approximately meanwhile. What arrived by then is applied; a batch missing after it then
shows as a gap."""


class StreamDropped(ConnectionError):
    """The publisher's connection dropped while live: the stream restarts (state kept)."""


class EventSink(Protocol):
    async def apply(self, endpoint: PublisherEndpoint, batch: EventBatch) -> None: ...

    async def lost(self, endpoint: PublisherEndpoint, first_missing: int, next_seen: int) -> None: ...

    async def restarted(self, endpoint: PublisherEndpoint) -> None: ...


class KvEventSubscriber:
    def __init__(self, endpoint: PublisherEndpoint, sink: EventSink, context: zmq.asyncio.Context, *,
                 replay_timeout_s: float = 1.0, on_incident: Callable[[str], None] | None = None,
                 on_live: Callable[[], None] | None = None, on_stopped: Callable[[str], None] | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, receive_hwm: int = RECEIVE_HWM_MESSAGES,
                 restart_backoff_min_s: float = RESTART_BACKOFF_MIN_S,
                 restart_backoff_max_s: float = RESTART_BACKOFF_MAX_S, loop_share: LoopShare | None = None) -> None:
        """``on_incident(outcome)`` is told of "gap", "healed", "lost", "restart", "decode_error";
        ``on_live()`` once the stream is live (connected and synced); ``on_stopped(reason)`` when
        ``run()`` stopped under ``supervise()`` (after ``live`` was cleared, before the restart);
        ``loop_share``: bounds the loop time its decoding takes (default: one of its own)."""
        self.endpoint = endpoint
        self.on_incident = on_incident
        self.on_live = on_live
        self.on_stopped = on_stopped
        self.max_message_bytes = max_message_bytes
        self.receive_hwm = receive_hwm
        self.restart_backoff_min_s = restart_backoff_min_s
        self.restart_backoff_max_s = max(restart_backoff_max_s, restart_backoff_min_s)
        self.restarts = 0
        self.loop_share = loop_share or LoopShare()
        self.live = asyncio.Event()
        self.synced = 0  # batches applied from the replay buffer on joining
        self.sink = sink
        self.context = context
        self.replay_timeout_s = replay_timeout_s
        self.tracker = SequenceTracker()
        self.applied = 0
        self.gaps = 0
        self.healed = 0
        self.decode_errors = 0
        self._sock: zmq.asyncio.Socket | None = None

    async def _socket(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        """The SUB socket and its handshake monitor (attached before the connect or bind: a
        handshake with a publisher already there completes at once); a bind retries while the
        address is still held (a predecessor's socket closing: a replica re-discovered after a
        restart), up to ``BIND_RETRY_S``."""
        sock = self._bounded(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, self.endpoint.topic)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        if not self.endpoint.bind:
            sock.connect(self.endpoint.endpoint)
            return sock, monitor
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BIND_RETRY_S
        while True:
            try:
                sock.bind(self.endpoint.endpoint)
                return sock, monitor
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or loop.time() > deadline:
                    sock.disable_monitor()
                    monitor.close(linger=0)
                    sock.close(linger=0)
                    raise
                await asyncio.sleep(0.05)

    def _bounded(self, kind: int) -> zmq.asyncio.Socket:
        """A socket whose inbound memory is bounded: a message part larger than
        ``max_message_bytes`` drops the peer's connection (a 100 MB message was once accepted
        whole), and at most ``receive_hwm`` messages queue before ZMQ drops more (a gap)."""
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, self.receive_hwm)
        return sock

    async def supervise(self) -> None:
        """``run()`` forever: restarted after it stopped for any reason (an exception from the
        sink, the socket, anything), after a delay doubling from ``restart_backoff_min_s`` up to
        ``restart_backoff_max_s`` (back to the minimum after a run that lasted the maximum).
        Cancellation stops it. The task itself never dies, so the stream is never silently gone."""
        loop = asyncio.get_running_loop()
        delay = self.restart_backoff_min_s
        while True:
            started = loop.time()
            dropped = False
            try:
                await self.run()
                reason = "stopped"
            except StreamDropped as exc:
                reason, dropped = str(exc), True
            except Exception as exc:  # noqa: BLE001 - any failure: approximate now, restart later
                reason = f"{type(exc).__name__}: {exc}"[:300]
            if loop.time() - started >= self.restart_backoff_max_s:
                delay = self.restart_backoff_min_s
            await self._stopped(reason, delay, keep_state=dropped)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.restart_backoff_max_s)

    async def _stopped(self, reason: str, delay: float, keep_state: bool = False) -> None:
        """Not live any more (the replica is routed approximately from now). After a failure what
        the index holds for the replica is dropped too: a batch that failed half-applied leaves
        it in a state no sequence number describes, so the next run starts over (a fresh tracker:
        the whole replay buffer when the publisher has one), as on first joining. After a dropped
        connection (``keep_state``) the index is intact: the next run resumes from the tracker,
        and what was missed meanwhile is a gap (replayed, or the replica uncertain)."""
        self.live.clear()
        self.restarts += 1
        log.warning("kv events from %s: subscriber stopped (%s); the replica is routed approximately, "
                    "restart in %.1f s", self.endpoint.endpoint, reason, delay)
        if self.on_stopped is not None:
            self.on_stopped(reason)
        if keep_state:
            return
        self.tracker = SequenceTracker()
        try:
            await self.sink.restarted(self.endpoint)
        except Exception as exc:  # noqa: BLE001 - the sink may be what failed; the stream is down anyway
            log.warning("kv events from %s: dropping entries after the stop failed: %r", self.endpoint.endpoint, exc)

    def close(self) -> None:
        """Close the socket now (releases a bound address before the task is cancelled)."""
        if self._sock is not None:
            self._sock.close(linger=0)

    async def run(self) -> None:
        """Join, sync, then apply live batches until the publisher's connection drops
        (``StreamDropped``) or something fails; ``supervise()`` runs it again."""
        sock, monitor = await self._socket()
        self._sock = sock
        try:
            await self._joined(monitor)
            await self._sync()
            self.live.set()
            if self.on_live is not None:
                self.on_live()
            await self._receive(sock, monitor)
        finally:
            if not sock.closed:  # closed: ``close()`` ran before the task was cancelled
                sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    async def _receive(self, sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        """Live batches, watching the connection: a dropped one (a message over
        ``max_message_bytes`` ends it for good, ZMQ does not reconnect after a protocol error)
        must not leave a silent socket trusted as a live stream."""
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll())
            if monitor in ready:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    raise StreamDropped("the publisher's connection dropped")
            if sock in ready:
                frames = await sock.recv_multipart()
                try:
                    batch = await self.decoded(message_steps(frames, token_ids=False))
                except KvEventError as exc:
                    self._decode_error(exc)
                    continue
                await self.handle(batch)

    async def decoded(self, steps: Generator[None, None, EventBatch]) -> EventBatch:
        """Run a decoder (``replicas.kv_events.decode_steps``) to its batch, resting between its
        chunks (``loop_share``): a 200,000-hash batch decoded at once held the loop ~10-20 ms."""
        started = time.perf_counter()
        while True:
            try:
                next(steps)
            except StopIteration as done:
                batch: EventBatch = done.value
                return batch
            await self.loop_share.rest(time.perf_counter() - started)
            started = time.perf_counter()

    async def _joined(self, monitor: zmq.asyncio.Socket) -> None:
        """Until the ZMTP handshake with the publisher succeeded (before it, nothing arrives)."""
        warn_after: float | None = JOIN_WARN_S
        while True:
            try:
                async with asyncio.timeout(warn_after):
                    event = parse_monitor_message(await monitor.recv_multipart())
            except TimeoutError:
                log.warning("kv events from %s: no publisher connected after %.0f s; the replica is routed "
                            "approximately until one does", self.endpoint.endpoint, warn_after)
                warn_after = None
                continue
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return

    async def _sync(self) -> None:
        """Apply the publisher's replay buffer (when it has a replay socket): what it sent before
        the handshake (from ``tracker.expected`` when a lease takeover set it: the previous
        holder relayed the rest). Live batches the replay covered are then skipped as duplicates."""
        if not self.endpoint.replay_endpoint:
            return
        # a lease takeover already applied the relayed batches: only what follows them
        buffered = await self.replay(self.tracker.expected or 0, ALL_BUFFERED,
                                     max(self.replay_timeout_s, JOIN_REPLAY_TIMEOUT_S))
        for batch in buffered:
            await self.handle(batch)
        self.synced = len(buffered)
        if buffered:
            self.tracker.synced_through = buffered[-1].seq
            log.info("kv events from %s: joined with %d buffered batch(es), through seq %d",
                     self.endpoint.endpoint, len(buffered), buffered[-1].seq)

    async def handle(self, batch: EventBatch) -> None:
        status, first_missing = self.tracker.observe(batch.seq)
        if status is SeqStatus.OLD:
            return
        if status is SeqStatus.RESTART:
            self._incident("restart")
            await self.sink.restarted(self.endpoint)
            first_missing = 0  # the new run's first batches may have gone out before it reconnected
        if first_missing < batch.seq:  # a gap, or a restart seen after its first batches
            self.gaps += 1
            self._incident("gap")
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
            self._incident("lost")
        else:
            self.healed += 1
            self._incident("healed")

    def _decode_error(self, exc: KvEventError) -> None:
        """Counted and logged (at DEBUG after the first few: a stream of garbage must not flood the log)."""
        self.decode_errors += 1
        self._incident("decode_error")
        level = logging.WARNING if self.decode_errors <= 10 else logging.DEBUG
        log.log(level, "kv events from %s: batch skipped (decode error %d): %s", self.endpoint.endpoint,
                self.decode_errors, exc)

    def _incident(self, outcome: str) -> None:
        if self.on_incident is not None:
            self.on_incident(outcome)

    async def replay(self, start: int, stop: int, timeout_s: float | None = None) -> list[EventBatch]:
        """Batches ``start <= seq < stop`` from the replay socket, in order (on a timeout, after
        ``timeout_s`` or ``replay_timeout_s``, or an error: those that arrived before it)."""
        assert self.endpoint.replay_endpoint is not None
        sock = self._bounded(zmq.DEALER)
        sock.connect(self.endpoint.replay_endpoint)
        out: list[EventBatch] = []
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(self.replay_timeout_s if timeout_s is None else timeout_s):
                while True:
                    frames = await sock.recv_multipart()
                    if len(frames) != 4:
                        raise KvEventError(f"replay reply has {len(frames)} frames")
                    seq = decode_seq(frames[2], signed=True)
                    if seq == REPLAY_END:
                        break
                    if start <= seq < stop:
                        try:
                            out.append(await self.decoded(decode_steps(seq, frames[3], token_ids=False)))
                        except KvEventError as exc:  # that batch only: it is then missing (a loss)
                            self._decode_error(exc)
        except (TimeoutError, KvEventError, zmq.ZMQError) as exc:
            log.warning("kv events replay from %s failed: %s", self.endpoint.replay_endpoint, exc)
        finally:
            sock.close(linger=0)
        return sorted(out, key=lambda b: b.seq)


class IndexSink:
    """Applies a replica's events to the precise index (``prefix_index.precise``)."""

    def __init__(self, index: EventBlockIndex, slice_hashes: int = APPLY_SLICE_HASHES,
                 loop_share: LoopShare | None = None) -> None:
        """``slice_hashes``: page hashes applied before yielding to the event loop;
        ``loop_share``: the bound on the loop time slices take, over every stream this sink applies."""
        self.index = index
        self.events = 0
        self.slice_hashes = max(slice_hashes, 1)
        self.loop_share = loop_share or LoopShare()

    async def apply(self, endpoint: PublisherEndpoint, batch: EventBatch) -> None:
        """In slices of ``slice_hashes`` hashes, resting between them (``LoopShare``): a batch of
        200k hashes applied at once blocked every request for as long (issue 41). A lookup
        between two slices sees the batch partly applied, as if it had come later."""
        replica = ReplicaId(endpoint.replica)
        budget, started = self.slice_hashes, time.perf_counter()
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.index.cleared(replica)
                budget -= 1
            else:
                budget, started = await self._apply_hashes(replica, event, budget, started)
            if budget <= 0:
                budget, started = await self._between_slices(started)
        self.events += len(batch.events)

    async def _between_slices(self, started: float) -> tuple[int, float]:
        """The loop's turn after a slice begun at ``started``; the next slice's budget and start."""
        await self.loop_share.rest(time.perf_counter() - started)
        return self.slice_hashes, time.perf_counter()

    async def _apply_hashes(self, replica: ReplicaId, event: BlockStored | BlockRemoved, budget: int,
                            started: float) -> tuple[int, float]:
        """One stored/removed event, its hashes in slices; the budget left of the current slice, and its start."""
        hashes = event.block_hashes
        apply = self.index.stored if isinstance(event, BlockStored) else self.index.removed
        i = 0
        while i < len(hashes):
            if budget <= 0:
                budget, started = await self._between_slices(started)
            part = hashes[i:i + budget]
            apply(replica, part, event.medium)
            i += len(part)
            budget -= len(part)
        return budget - (0 if hashes else 1), started

    async def lost(self, endpoint: PublisherEndpoint, first_missing: int, next_seen: int) -> None:
        self.index.uncertain.add(ReplicaId(endpoint.replica))

    async def restarted(self, endpoint: PublisherEndpoint) -> None:
        self.index.cleared(ReplicaId(endpoint.replica))


class Relay(Protocol):
    async def relay(self, replica: str, kind: str, rank: int, seq: int, payload: bytes = b"") -> None: ...


class RelaySink:
    """Applies through ``inner`` and relays every batch (and loss, restart) to the other
    gateways (``prefix_index.event_lease.EventLease.relay``): the lease holder's sink."""

    def __init__(self, inner: EventSink, relay: Relay) -> None:
        self.inner = inner
        self.relay_to = relay

    async def apply(self, endpoint: PublisherEndpoint, batch: EventBatch) -> None:
        await self.inner.apply(endpoint, batch)
        await self.relay_to.relay(endpoint.replica, "batch", endpoint.dp_rank, batch.seq,
                                  encode_batch(batch.events, batch.ts, batch.dp_rank))

    async def lost(self, endpoint: PublisherEndpoint, first_missing: int, next_seen: int) -> None:
        await self.inner.lost(endpoint, first_missing, next_seen)
        await self.relay_to.relay(endpoint.replica, "lost", endpoint.dp_rank, next_seen)

    async def restarted(self, endpoint: PublisherEndpoint) -> None:
        await self.inner.restarted(endpoint)
        await self.relay_to.relay(endpoint.replica, "restart", endpoint.dp_rank, 0)
