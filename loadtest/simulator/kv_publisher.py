"""The simulated replica's KV-cache events, published as SGLang 0.5.23 does.

Three parts, each usable alone:

* :class:`KvEventsConfig`: SGLang's ``--kv-events-config`` JSON (``publisher``,
  ``endpoint``, ``bind``, ``replay_endpoint``, ``buffer_steps``, ``hwm``, ``topic``; unknown
  keys are dropped, as pydantic does, so ``{"enable_kv_cache_events": true}`` publishes
  nothing) and the ``/server_info.kv_events`` descriptor built from it (contract §2.4).
* :class:`KvEventRecorder`: the paged cache's observer (``kvcache.CacheObserver``). The cache
  names pages by xxh3 chains; the recorder keeps, per resident page, SGLang's name of it:
  ``digest_k = SHA256(digest_{k-1} || page tokens as <u4)`` and its published int64
  (``gateway.sglang_pages``), computed once when the engine first stores the page
  (``name``), forgotten when the page leaves both tiers. Cache moves become
  ``replicas.kv_events`` values: ``BlockStored`` (chains coalesced, with the parent hash
  and the pages' token ids), ``BlockRemoved`` (consecutive ones of one medium coalesced),
  ``AllBlocksCleared``; media ``GPU`` (device) and ``CPU_PINNED`` (HiCache host: an eviction
  is BlockRemoved GPU + BlockStored CPU_PINNED, a load-back the reverse). The engine ends a
  batch once per scheduler step (``end_step``) and hands it to a sink.
* :class:`ZmqKvPublisher`: the sink of a real replica process. PUB socket,
  multipart ``[topic, seq (8 bytes big-endian, from 0), msgpack([ts, events, dp_rank])]``
  (``replicas.kv_events.encode_batch``), a bounded buffer of the last ``buffer_steps``
  batches and a ROUTER replay socket (``[b"", start_seq]`` -> ``[b"", topic, seq, payload]``
  per buffered batch with seq >= start, then ``[b"", b"", -1, b""]``). Batches are queued
  by the engine's step and sent by an asyncio task (SGLang: a background thread), so a
  step never waits on a socket.

Extension: port 0 in an endpoint picks a free port at start (``with_free_ports``), so one
flag serves a fleet of replicas (``kvgate sim --replicas N``, ``SimFleet(extra_args=...)``).

Deviation, so that nothing leaves the machine: a wildcard host (``*``, ``0.0.0.0``, ``::``)
binds the replica's own ``--host`` (127.0.0.1 by default), not every interface; consumers
replace the wildcard with the replica's host anyway (``replicas.kv_events.publishers``).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import struct
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

import numpy as np
import numpy.typing as npt
import orjson
import zmq
import zmq.asyncio

from loadtest.simulator.ports import free_port
from replicas.kv_events import (
    REPLAY_END,
    WILDCARD_HOSTS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    encode_batch,
)

log = logging.getLogger("kvgate.sim.kv_events")

BatchSink = Callable[[tuple[Event, ...], float], None]


class KvEventsConfigError(ValueError):
    """A ``--kv-events-config`` that is not a JSON object of the right shape."""


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    bind: bool | None = None
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    format: str = "default"

    @classmethod
    def from_json(cls, text: str) -> KvEventsConfig:
        try:
            raw = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise KvEventsConfigError(f"--kv-events-config is not JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise KvEventsConfigError("--kv-events-config must be a JSON object")
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        try:
            return cls(**known)
        except TypeError as exc:
            raise KvEventsConfigError(str(exc)) from exc

    @property
    def enabled(self) -> bool:
        return self.publisher == "zmq"

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _split_tcp(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of a ``tcp://host:port`` endpoint; None for ipc/inproc or malformed."""
    parts = urlsplit(endpoint.replace("tcp://*:", "tcp://__any__:", 1))
    if parts.scheme != "tcp" or parts.port is None:
        return None
    host = parts.hostname or ""
    return ("*" if host == "__any__" else host), parts.port


def publisher_binds(config: KvEventsConfig) -> bool:
    """SGLang's rule: bind for a wildcard host or a non-TCP endpoint, else connect."""
    if config.bind is not None:
        return config.bind
    tcp = _split_tcp(config.endpoint)
    return tcp is None or tcp[0] in WILDCARD_HOSTS


def local_endpoint(endpoint: str, host: str) -> str:
    """``endpoint`` with a wildcard host replaced by the replica's own host."""
    tcp = _split_tcp(endpoint)
    if tcp is None or tcp[0] not in WILDCARD_HOSTS:
        return endpoint
    return f"tcp://{host}:{tcp[1]}"


def with_free_ports(config: KvEventsConfig, host: str) -> KvEventsConfig:
    """A simulator extension: port 0 in ``endpoint`` / ``replay_endpoint`` becomes a free
    port of ``host`` (so N replicas can share one flag; /server_info advertises the ports)."""
    def fix(endpoint: str | None) -> str | None:
        tcp = _split_tcp(endpoint) if endpoint else None
        if endpoint is None or tcp is None or tcp[1] != 0:
            return endpoint
        return f"tcp://{tcp[0]}:{free_port(host)}"

    return dataclasses.replace(config, endpoint=fix(config.endpoint) or config.endpoint,
                               replay_endpoint=fix(config.replay_endpoint))


def descriptor(config: KvEventsConfig | None, block_size: int, dp_size: int = 1) -> dict[str, Any] | None:
    """``/server_info.kv_events`` (contract §2.4); None when nothing routable is published."""
    if config is None or not config.enabled or block_size <= 0:
        return None
    tcp = _split_tcp(config.endpoint)
    if tcp is None:
        return None
    out: dict[str, Any] = {"publisher": "zmq", "endpoint_host": tcp[0], "endpoint_port_base": tcp[1],
                           "topic": config.topic, "block_size": block_size, "dp_size": dp_size,
                           "load_topic": "load"}
    replay = _split_tcp(config.replay_endpoint) if config.replay_endpoint else None
    if replay is not None:
        out["replay_endpoint_port_base"] = replay[1]
    return out


# ------------------------------------------------------------------------- recorder
# SGLang's name of one resident page: (published int64, 32-byte digest (the next page's
# chain input), the cache's id of the page before it (None at the root), that page's
# published hash, the page's token ids as <u4 bytes (None: not kept)). A plain tuple: a
# page is named on every commit of a new page, so construction cost counts.
_Name = tuple[int, bytes, int | None, int | None, bytes | None]
_HASH: Final = 0
_DIGEST: Final = 1
_PARENT: Final = 2
_PARENT_HASH: Final = 3
_TOKENS: Final = 4
_INT64 = struct.Struct(">q")  # the digest's first 8 bytes, big-endian, signed


class KvEventRecorder:
    """Turns the cache's page moves into SGLang events, one batch per scheduler step.

    ``keep_token_ids=False`` publishes ``BlockStored`` without token ids (an in-process
    consumer that reads only hashes, e.g. the virtual-time fleet, saves the memory).
    """

    def __init__(self, page_size: int, sink: BatchSink | None = None, *, keep_token_ids: bool = True) -> None:
        self.page_size = page_size
        self.sink = sink
        self.keep_token_ids = keep_token_ids
        self.names: dict[int, _Name] = {}
        self.pending: list[Event] = []
        self.batches = 0
        self.events = 0

    # -- naming (the engine, before it commits pages) -------------------------------
    def name(self, parent: int | None, pages: Sequence[int], tokens: npt.NDArray[Any]) -> None:
        """Name ``pages`` (the cache's ids, a chain after ``parent``) from their tokens."""
        names = self.names
        prior = names[parent] if parent is not None else None
        digest, prev_hash = (prior[_DIGEST], prior[_HASH]) if prior else (b"", None)
        data = np.ascontiguousarray(tokens, dtype="<u4").tobytes()
        step, keep, sha, unpack = self.page_size * 4, self.keep_token_ids, hashlib.sha256, _INT64.unpack_from
        prev_id = parent
        for k, page in enumerate(pages):
            known = names.get(page)
            if known is None:
                chunk = data[k * step:(k + 1) * step]
                digest = sha(digest + chunk).digest()
                h: int = unpack(digest)[0]
                names[page] = (h, digest, prev_id, prev_hash, chunk if keep else None)
            else:
                h, digest = known[_HASH], known[_DIGEST]
            prev_id, prev_hash = page, h

    def sglang_hash(self, page: int) -> int | None:
        name = self.names.get(page)
        return None if name is None else name[_HASH]

    # -- kvcache.CacheObserver ------------------------------------------------------
    def stored(self, pages: Sequence[int], medium: str) -> None:
        names = self.names
        for run in self._runs(pages):
            entries = [names[p] for p in run]
            tokens: tuple[int, ...] = ()
            if self.keep_token_ids:
                raw = b"".join([e[_TOKENS] or b"" for e in entries])
                tokens = tuple(np.frombuffer(raw, dtype="<u4").tolist())
            self.pending.append(BlockStored(tuple([e[_HASH] for e in entries]), entries[0][_PARENT_HASH],
                                            tokens, self.page_size, medium))

    def removed(self, pages: Sequence[int], medium: str) -> None:
        if not pages:
            return
        names = self.names
        hashes = tuple([names[p][_HASH] for p in pages])
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            self.pending[-1] = BlockRemoved(last.block_hashes + hashes, medium)
        else:
            self.pending.append(BlockRemoved(hashes, medium))

    def forget(self, pages: Sequence[int]) -> None:
        for p in pages:
            self.names.pop(p, None)

    def cleared(self) -> None:
        self.names.clear()
        self.pending.append(AllBlocksCleared())

    def _runs(self, pages: Sequence[int]) -> list[list[int]]:
        """``pages`` cut into chains (each in root-to-leaf order): consecutive pages where
        one is the other's parent, in either direction (evictions come leaf first)."""
        runs: list[list[int]] = []
        run: list[int] = []
        forward: bool | None = None
        names = self.names
        for p in pages:
            if run:
                if forward is not False and names[p][_PARENT] == run[-1]:
                    forward = True
                    run.append(p)
                    continue
                if forward is not True and names[run[-1]][_PARENT] == p:
                    forward = False
                    run.append(p)
                    continue
                runs.append(run if forward is not False else run[::-1])
            run, forward = [p], None
        if run:
            runs.append(run if forward is not False else run[::-1])
        return runs

    # -- batching ---------------------------------------------------------------------
    def end_step(self, ts: float) -> None:
        """Close the scheduler step: the pending events become one batch for the sink."""
        if not self.pending:
            return
        batch, self.pending = tuple(self.pending), []
        self.batches += 1
        self.events += len(batch)
        if self.sink is not None:
            self.sink(batch, ts)


# ------------------------------------------------------------------------- ZMQ publisher
class ZmqKvPublisher:
    """One DP rank's PUB socket, replay buffer and ROUTER socket (module docstring)."""

    def __init__(self, config: KvEventsConfig, host: str = "127.0.0.1", dp_rank: int = 0) -> None:
        self.config = config
        self.host = host
        self.dp_rank = dp_rank
        self.topic = config.topic.encode()
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=max(config.buffer_steps, 1))
        self._queue: deque[tuple[tuple[Event, ...], float]] = deque()
        self._wake: asyncio.Event | None = None
        self.dropped = 0
        self.replays = 0

    def publish(self, events: tuple[Event, ...], ts: float) -> None:
        """A step's batch (the recorder's sink): queued, sent by ``run`` (never blocks)."""
        if len(self._queue) >= self.config.max_queue_size:
            self.dropped += 1
            return
        self._queue.append((events, ts))
        if self._wake is not None:
            self._wake.set()

    def _pub_socket(self, ctx: zmq.asyncio.Context) -> zmq.asyncio.Socket:
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.config.hwm)
        endpoint = local_endpoint(self.config.endpoint, self.host)
        if publisher_binds(self.config):
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
        return sock

    def _router_socket(self, ctx: zmq.asyncio.Context) -> zmq.asyncio.Socket | None:
        if not self.config.replay_endpoint:
            return None
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(local_endpoint(self.config.replay_endpoint, self.host))
        return sock

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Open the sockets and run the sender and the replay server for the block's span."""
        ctx = zmq.asyncio.Context()
        pub, router = self._pub_socket(ctx), self._router_socket(ctx)
        self._wake = asyncio.Event()
        tasks = [asyncio.create_task(self._send_loop(pub), name="kv-events-pub")]
        if router is not None:
            tasks.append(asyncio.create_task(self._replay_loop(router), name="kv-events-replay"))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            pub.close(linger=0)
            if router is not None:
                router.close(linger=0)
            ctx.term()

    async def _send_loop(self, pub: zmq.asyncio.Socket) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            while self._queue:
                events, _ = self._queue.popleft()
                payload = encode_batch(events, time.time(), self.dp_rank)
                seq = self.seq.to_bytes(8, "big")
                self.buffer.append((self.seq, payload))
                self.seq += 1
                try:
                    await pub.send_multipart([self.topic, seq, payload], flags=zmq.NOBLOCK)
                except zmq.Again:
                    self.dropped += 1  # PUB at its high-water mark: SGLang drops too
            await self._wake.wait()

    async def _replay_loop(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            if len(frames) < 3 or len(frames[2]) != 8:
                log.warning("kv events replay: malformed request (%d frames)", len(frames))
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            self.replays += 1
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await router.send_multipart([ident, b"", self.topic, seq.to_bytes(8, "big"), payload])
            await router.send_multipart([ident, b"", b"", REPLAY_END.to_bytes(8, "big", signed=True), b""])
