"""Precise mode's wiring: one KV-event subscriber per replica DP rank, and the request lookup.

``attach_precise(settings, client, registry, router, metrics)`` (the gateway's lifespan
calls it; ``None`` when ``index.mode == "approximate"``) returns a ``PreciseMode`` that

- listens to the registry: a replica joining (or coming back to ACTIVE) has its
  ``/server_info`` read; when it advertises ``kv_events`` a subscriber task per DP rank
  starts (``replicas.kv_subscriber``), applying its events to one ``EventBlockIndex``.
  A replica leaving has its subscribers stopped and its entries dropped; a replica whose
  ``/server_info`` changed identity (``startup_time``: it restarted) has its entries
  dropped; a stream gap that could not be replayed marks the replica *uncertain* (it is
  then routed approximately until an ``AllBlocksCleared`` or a restart rebuilds it);
- answers ``await lookup(ctx, replica_ids)`` on the request path (``gateway.router``): the
  request's token ids (``gateway.precise_tokens``: the model's tokenizer and chat
  template) hashed as SGLang hashes pages, in ``gateway.precise_pool``'s worker threads
  (bounded queue, per-request deadline: past them the request is routed approximately),
  then matched against the event index on the loop, per replica in tokens
  (``to_prefix_match(..., block_tokens=1)``), only for replicas in precise mode.

Nothing here blocks the request path on the network: discovery and subscribers are
background tasks owned by this object, cancelled by ``close()``. A replica is in precise
mode once a tokenizer for it loaded (its ``model_path`` when it is a local directory, else
``index.tokenizer_dir``; ``gateway.precise_formats``: a directory precise mode cannot
reproduce exactly stays approximate, its reason logged, counted in
``kvgate_precise_unreproducible_replicas{reason}`` and shown by ``/admin/replicas``) and
its streams are *live* (``KvEventSubscriber.live``: connected
to every DP rank's publisher and synced from its replay buffer when it has one); until
then it is routed approximately, so a publisher the gateway cannot reach, or the moments
before it connects, never pass for an empty cache.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import socket
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import zmq.asyncio

from gateway.metrics import GatewayMetrics
from gateway.precise_formats import REASONS
from gateway.precise_models import PreciseModels
from gateway.sglang_pages import uses_bigrams
from policies.base import RequestContext
from prefix_index.base import PrefixMatch, ReplicaId
from prefix_index.config import IndexConfig
from prefix_index.event_lease import EventLease, RelayEntry
from prefix_index.precise import EventBlockIndex, to_prefix_match
from replicas.kv_events import KvEventError, PublisherEndpoint, decode_batch, publishers
from replicas.kv_subscriber import (
    APPLY_SLICE_HASHES,
    EventSink,
    IndexSink,
    KvEventSubscriber,
    RelaySink,
)
from replicas.model import ReplicaState, ReplicaView

log = logging.getLogger("kvgate.precise")
INFO_TIMEOUT_S = 5.0
ENDPOINTS = frozenset({"chat", "completions", "generate", "messages", "responses"})

InfoFetcher = Callable[[str], Awaitable[Mapping[str, Any] | None]]


@dataclass(frozen=True, slots=True)
class PreciseAnswer:
    prompt_tokens: int
    matches: dict[ReplicaId, PrefixMatch]  # in tokens, for the replicas in precise mode


@dataclass(slots=True)
class _Replica:
    endpoints: tuple[PublisherEndpoint, ...]
    page_size: int
    bigram: bool
    model_dir: str
    identity: str
    tasks: list[asyncio.Task[None]]
    subscribers: list[KvEventSubscriber]

    @property
    def live(self) -> bool:
        """Every stream joined (a lease follower has none: it applies the holder's relay)."""
        return all(sub.live.is_set() for sub in self.subscribers)


class MeteredSink(IndexSink):
    """``IndexSink`` that also counts into the gateway's metrics."""

    def __init__(self, index: EventBlockIndex, metrics: GatewayMetrics | None,
                 slice_hashes: int = APPLY_SLICE_HASHES) -> None:
        super().__init__(index, slice_hashes)
        self.metrics = metrics
        self.on_cleared: Callable[[], None] | None = None
        """Told after an ``AllBlocksCleared`` (it makes an uncertain replica certain again: the
        gauges of replicas by mode must show it without waiting for another incident)."""

    async def apply(self, endpoint: PublisherEndpoint, batch: Any) -> None:
        await super().apply(endpoint, batch)
        if self.metrics is not None:
            self.metrics.kv_events_applied.labels(endpoint.replica).inc(len(batch.events))
            cleared = sum(1 for e in batch.events if type(e).__name__ == "AllBlocksCleared")
            if cleared:
                self.metrics.kv_stream("cleared", cleared)
                if self.on_cleared is not None:
                    self.on_cleared()


def http_fetcher(client: httpx.AsyncClient, timeout_s: float = INFO_TIMEOUT_S) -> InfoFetcher:
    async def fetch(url: str) -> Mapping[str, Any] | None:
        try:
            response = await client.get(url + "/server_info", timeout=timeout_s)
            body = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            log.info("server_info of %s failed: %s", url, exc)
            return None
        return body if isinstance(body, dict) else None

    return fetch


class PreciseMode:
    """The registry listener and the request-path lookup of precise mode."""

    def __init__(self, config: IndexConfig, fetch_info: InfoFetcher, *, metrics: GatewayMetrics | None = None,
                 index: EventBlockIndex | None = None, replay_timeout_s: float = 1.0,
                 lease: EventLease | None = None) -> None:
        """``lease``: several gateways on one Redis (``prefix_index.event_lease``): only the
        lease holder subscribes to a replica, the others apply what it relays."""
        self.config = config
        self.lease = lease
        self.fetch_info = fetch_info
        self.metrics = metrics
        self.index = index or EventBlockIndex()
        self.sink = MeteredSink(self.index, metrics, config.event_apply_slice_hashes)
        self.sink.on_cleared = self._gauges
        self.replay_timeout_s = replay_timeout_s
        self.context = zmq.asyncio.Context()
        self._replicas: dict[ReplicaId, _Replica] = {}
        self.models = PreciseModels(config, metrics)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._generation: dict[ReplicaId, int] = {}

    # ---------------------------------------------------------------- background
    def _spawn(self, coro: Coroutine[Any, Any, object], name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("precise mode task %s failed: %r", task.get_name(), task.exception())

    def _incident(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.kv_stream(outcome)
        self._gauges()

    def precise_replicas(self) -> list[ReplicaId]:
        """The replicas matched from their events now: streams live, index certain."""
        return [r for r, state in self._replicas.items() if state.live and r not in self.index.uncertain]

    def _gauges(self) -> None:
        if self.metrics is not None:
            uncertain = sum(1 for r in self._replicas if r in self.index.uncertain)
            precise = len(self.precise_replicas())
            self.metrics.precise_replicas.labels("precise").set(precise)
            self.metrics.precise_replicas.labels("uncertain").set(uncertain)
            self.metrics.precise_replicas.labels("joining").set(len(self._replicas) - uncertain - precise)
            for reason in REASONS:
                self.metrics.precise_unreproducible.labels(reason).set(self.models.unreproducible(reason))

    # ---------------------------------------------------------------- registry listener
    def on_added(self, view: ReplicaView) -> None:
        self._discover_soon(view.id)

    def on_state_changed(self, view: ReplicaView, old_state: ReplicaState) -> None:
        if view.state is ReplicaState.ACTIVE and old_state is not ReplicaState.ACTIVE:
            self._discover_soon(view.id)  # back from unhealthy/joining: it may have restarted

    def on_removed(self, replica_id: ReplicaId) -> None:
        self._generation[replica_id] = self._generation.get(replica_id, 0) + 1
        self._stop(replica_id)
        self.models.forget(replica_id)
        self.index.drop(replica_id)
        self._gauges()

    def _discover_soon(self, replica: ReplicaId) -> None:
        generation = self._generation.setdefault(replica, 0)
        try:
            self._spawn(self.discover(replica, generation), f"kv-discover {replica}")
        except RuntimeError:  # no running loop (a listener call outside the app): nothing to start
            log.warning("precise mode: no event loop to discover %s", replica)

    async def discover(self, replica: ReplicaId, generation: int | None = None) -> bool:
        """Read the replica's /server_info and (re)start its subscribers; True when precise."""
        info = await self.fetch_info(replica)
        if generation is not None and self._generation.get(replica, 0) != generation:
            return False  # removed meanwhile
        if info is None:
            return replica in self._replicas
        endpoints = self._endpoints(replica, info)
        identity = repr(info.get("startup_time")) + repr(info.get("launch_command"))
        current = self._replicas.get(replica)
        if current is not None and current.endpoints == endpoints and current.identity == identity:
            return True
        self._stop(replica)
        self.index.cleared(replica)  # a new server (or new endpoints): what we knew is stale
        model_dir = self.models.model_dir(replica, info) if endpoints else None
        if model_dir is None:
            self._gauges()
            return False
        page = endpoints[0].block_size or int(info.get("page_size") or 1)
        state = _Replica(endpoints, max(page, 1), uses_bigrams(info.get("speculative_algorithm")), model_dir,
                         identity, [], [])
        if self.lease is None:
            self._subscribe(state, self.sink, {})
        else:
            state.tasks.append(self._spawn(self._coordinate(replica, state, self.lease), f"kv-lease {replica}"))
        self._replicas[replica] = state
        self._gauges()
        log.info("precise mode for %s: %d publisher(s), page %d%s", replica, len(endpoints), state.page_size,
                 ", bigram" if state.bigram else "")
        return True

    def _endpoints(self, replica: ReplicaId, info: Mapping[str, Any]) -> tuple[PublisherEndpoint, ...]:
        """The replica's publishers; none (approximate, a WARNING) for an advertisement refused
        (``index.event_max_dp_size`` exceeded, ports out of range, a malformed block size)."""
        try:
            return tuple(publishers(replica, info, self.config.event_max_dp_size))
        except KvEventError as exc:
            log.warning("precise mode refused for %s: %s; routed approximately", replica, exc)
            return ()

    def _subscribe(self, state: _Replica, sink: EventSink, after: Mapping[int, int]) -> list[asyncio.Task[None]]:
        """Start one supervised subscriber per DP rank (its tracker expecting ``after[rank] + 1``
        when known): restarted after any failure, its replica approximate until live again."""
        started = []
        cfg = self.config
        for ep in state.endpoints:
            sub = KvEventSubscriber(ep, sink, self.context, replay_timeout_s=self.replay_timeout_s,
                                    on_incident=self._incident, on_live=self._gauges,
                                    on_stopped=functools.partial(self._stopped, ep.replica),
                                    max_message_bytes=cfg.event_max_message_bytes,
                                    receive_hwm=cfg.event_receive_hwm_messages,
                                    restart_backoff_min_s=cfg.event_restart_backoff_min_s,
                                    restart_backoff_max_s=cfg.event_restart_backoff_max_s)
            if ep.dp_rank in after:
                sub.tracker.expected = after[ep.dp_rank] + 1
            state.subscribers.append(sub)
            started.append(self._spawn(sub.supervise(), f"kv-events {ep.endpoint}"))
        state.tasks += started
        return started

    def _stopped(self, replica: str, reason: str) -> None:
        """A subscriber stopped (it logged why): counted, and the gauges show the replica joining."""
        if self.metrics is not None:
            self.metrics.kv_subscriber_restarts.labels(replica).inc()
        self._gauges()

    async def _coordinate(self, replica: ReplicaId, state: _Replica, lease: EventLease) -> None:
        """Hold the lease and subscribe, or follow the holder's relay stream; hand over on lapse."""
        last_id, last_seq = "0-0", dict[int, int]()
        leading: list[asyncio.Task[None]] = []
        loop = asyncio.get_running_loop()
        try:
            while True:
                if await lease.hold(replica):
                    if not leading:  # taking over: catch up with what the last holder relayed first
                        last_id = await self._follow(state, lease, replica, last_id, last_seq, None)
                        leading = self._subscribe(state, RelaySink(self.sink, lease), last_seq)
                    await asyncio.sleep(lease.renew_interval_s)
                    continue
                for task in leading:
                    task.cancel()
                for sub in state.subscribers:
                    sub.close()
                leading, state.subscribers = [], []
                deadline = loop.time() + lease.renew_interval_s
                while (left := deadline - loop.time()) > 0:
                    last_id = await self._follow(state, lease, replica, last_id, last_seq, max(int(left * 1000), 1))
        finally:
            if leading:
                for task in leading:
                    task.cancel()
                await asyncio.shield(lease.release(replica))

    async def _follow(self, state: _Replica, lease: EventLease, replica: ReplicaId, after: str,
                      last_seq: dict[int, int], block_ms: int | None) -> str:
        """Apply relayed entries after ``after`` (``block_ms`` None: only what is there now)."""
        while True:
            entries = await lease.read(replica, after, block_ms)
            for entry in entries:
                await self._apply_relayed(state, entry)
                last_seq[entry.rank] = entry.seq
                after = entry.id
            if block_ms is not None or not entries:
                return after

    async def _apply_relayed(self, state: _Replica, entry: RelayEntry) -> None:
        ep = next((e for e in state.endpoints if e.dp_rank == entry.rank), None)
        if ep is None:
            return
        if entry.kind == "batch":
            try:
                batch = decode_batch(entry.seq, entry.payload)
            except KvEventError as exc:  # a relayed batch is re-encoded by the holder; still never fatal
                log.warning("precise mode: relayed batch for %s undecodable: %s", state.endpoints[0].replica, exc)
                self._incident("decode_error")
                return
            await self.sink.apply(ep, batch)
        elif entry.kind == "lost":
            await self.sink.lost(ep, entry.seq, entry.seq)
        elif entry.kind == "restart":
            await self.sink.restarted(ep)

    def replica_status(self, replica: ReplicaId) -> dict[str, Any]:
        """Precise mode as ``/admin/replicas`` shows it for one replica."""
        state = self._replicas.get(replica)
        if state is not None:
            mode = ("uncertain" if replica in self.index.uncertain else "precise" if state.live else "joining")
            return {"mode": mode, "model_dir": state.model_dir, "tokenizer": self.models.kind(state.model_dir),
                    "tool_declaration": self.models.tool_declaration(state.model_dir), "page_size": state.page_size}
        return self.models.approximate_status(replica)

    def _stop(self, replica: ReplicaId) -> None:
        state = self._replicas.pop(replica, None)
        if state is not None:
            for sub in state.subscribers:
                sub.close()
            for task in state.tasks:
                task.cancel()

    def stream_counts(self) -> dict[str, int]:
        """Totals over the live subscribers: applied batches, gaps, healed gaps, decode errors."""
        subs = [s for r in self._replicas.values() for s in r.subscribers]
        return {"applied": sum(s.applied for s in subs), "gaps": sum(s.gaps for s in subs),
                "healed": sum(s.healed for s in subs), "decode_errors": sum(s.decode_errors for s in subs)}

    # ---------------------------------------------------------------- request path
    async def lookup(self, ctx: RequestContext, replicas: Sequence[ReplicaId]) -> PreciseAnswer | None:
        """Exact matches in tokens for the replicas in precise mode (None: none, or not
        tokenizable now: then the request is routed approximately). The prompt is tokenized
        and hashed in the pool; only the match runs on the loop."""
        if ctx.payload is None or ctx.endpoint not in ENDPOINTS:
            return None
        groups: dict[tuple[str, int, bool], list[ReplicaId]] = {}
        for r in replicas:
            state = self._replicas.get(r)
            if state is not None and state.live and r not in self.index.uncertain:
                groups.setdefault((state.model_dir, state.page_size, state.bigram), []).append(r)
        if not groups:
            return None
        matches: dict[ReplicaId, PrefixMatch] = {}
        tokens = 0
        for key, members in groups.items():
            prompt = await self.models.hashes(ctx, *key)
            if prompt is None:
                return None
            tokens = prompt.tokens
            for r, m in self.index.match(prompt.hashes, [m for m in members if m in self._replicas]).items():
                matches[r] = to_prefix_match(m.device_blocks, m.host_blocks, prompt.page_size)
        return PreciseAnswer(tokens, matches)

    async def close(self) -> None:
        """Stop every task (a lease held is released, so another gateway takes over at once)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._replicas.clear()
        self.models.close()
        if self.lease is not None:
            await self.lease.close()
        self.context.destroy(linger=0)


def attach_precise(config: IndexConfig, client: httpx.AsyncClient, listeners: Any, router: Any,
                   metrics: GatewayMetrics | None) -> PreciseMode | None:
    """Precise mode for a gateway: registered as a registry listener (``listeners.add_listener``)
    and as the router's lookup (``router.precise``); None when ``config.mode == "approximate"``."""
    if config.mode == "approximate":
        return None
    existing = getattr(router, "precise", None)
    if isinstance(existing, PreciseMode):
        return existing
    lease = None
    if config.redis_url:
        lease = EventLease.from_url(config.redis_url, f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}",
                                    key_prefix=config.key_prefix, ttl_s=config.event_lease_ttl_s)
    mode = PreciseMode(config, http_fetcher(client), metrics=metrics, lease=lease)
    listeners.add_listener(mode)
    router.precise = mode
    return mode
