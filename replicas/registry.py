"""The replica registry: membership, lifecycle state machine, probes, load, drain.

    add() -> JOINING --first OK probe + /server_info--> ACTIVE <--hysteresis--> UNHEALTHY
                                                          |  ^ /ready 200 (self-drain only)
                         drain() or /ready 503            v  |
                                                       DRAINING --empty or deadline--> removed

One instance per gateway process. Background loops (probes, /v1/loads polls, drain
deadlines, shared-state sync) are asyncio tasks owned by ``start()``/``stop()``; each
loop body is also a public coroutine (``probe_all``, ``poll_loads``, ``check_drains``,
``sync_shared``) so tests drive them with a fake clock. The drain check runs only while
a replica drains (an idle wake-up costs ~0.15 ms of CPU on these machines: the
background is counted per request in ``kvgate bench peers``). See replicas/README.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import httpx

from prefix_index.base import ReplicaId
from replicas import probe
from replicas.config import RegistryConfig
from replicas.drain import DrainInfo, drain_outcome
from replicas.health import HealthEvent, HealthTracker, next_state, state_after_undrain
from replicas.load import LoadCounters, LoadLease
from replicas.model import ReplicaState, ReplicaView
from replicas.outlier import OutlierDetector
from replicas.record import Ejections, RegistryListener, ReplicaRecord, ReplicaTable, normalize_url
from replicas.shared_state import SharedSnapshot, SharedState
from replicas.shared_sync import SharedDiff, SharedLink
from replicas.speed import FLEET_DECODE_STEP_S, FLEET_PREFILL_TOKENS_PER_S, ReplicaSpeed

log = logging.getLogger(__name__)

__all__ = ["LoadLease", "Registry", "RegistryListener"]


def _nothing_held(replica: ReplicaId) -> tuple[int, ...]:
    return ()


class Registry:
    def __init__(
        self,
        config: RegistryConfig,
        client: httpx.AsyncClient,
        *,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedState | None = None,
        probes: probe.Getter | None = None,
        speed_seed: tuple[float, float] = (FLEET_PREFILL_TOKENS_PER_S, FLEET_DECODE_STEP_S),
    ) -> None:
        """``probes``: how probes and load polls GET (default: over ``client``), closed at
        ``stop``; ``speed_seed``: every replica's learned speed starts there (`speed.fleet_seed`)."""
        self.config = config
        self._speed_seed = speed_seed
        self._get = probes or probe.HttpxGetter(client)
        self._clock = clock
        self._link = SharedLink(shared, config.shared) if shared is not None else None
        self._table = ReplicaTable()
        self._static = (
            {normalize_url(u) for u in config.replicas} if config.discovery == "static" else set()
        )
        self._loops: list[asyncio.Task[None]] = []
        self._draining = asyncio.Event()  # some replica is DRAINING: the drain check runs
        self._background: set[asyncio.Task[Any]] = set()
        self._ejections = Ejections(self._table, OutlierDetector(config.outlier), clock)
        self._probe_log = probe.ProbeLog(config.probe_log_interval_s, clock)
        self._served: frozenset[str] | None = None  # served_models(), None: to compute
        self._table.add_listener(_ForgetServed(self._forget_served))
        # what the gateway's admission holds per replica (gateway.admission; none by default)
        self.held_prefill: Callable[[ReplicaId], tuple[int, ...]] = _nothing_held

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        await asyncio.gather(*(self.add(u) for u in self.config.replicas))
        c = self.config
        loops: list[tuple[float, Callable[[], Awaitable[None]]]] = [
            (c.probe_interval_s, self.probe_all),
            (c.loads_poll_interval_s, self.poll_loads),
        ]
        if self._link is not None:
            await self.sync_shared()
            loops.append((c.shared.sync_interval_s, self.sync_shared))
        self._loops = [
            asyncio.create_task(self._every(i, fn), name=f"registry-{fn.__name__}")
            for i, fn in loops
        ]
        self._loops.append(asyncio.create_task(
            self._every(c.drain_check_interval_s, self._check_drains_async, gate=self._draining),
            name="registry-check_drains"))

    async def stop(self) -> None:
        tasks = [*self._loops, *self._background]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loops.clear()
        if self._link is not None:
            await self._link.close()
        await self._get.close()

    async def _every(self, interval_s: float, fn: Callable[[], Awaitable[None]],
                     gate: asyncio.Event | None = None) -> None:
        """``fn`` every ``interval_s`` (start to start; at once after a run longer than that);
        with a ``gate``, only while it is set (asleep otherwise)."""
        loop = asyncio.get_running_loop()
        while True:
            if gate is not None:
                await gate.wait()
            started = loop.time()
            try:
                await fn()
            except Exception:  # a loop must survive one bad iteration
                log.exception("registry loop %s failed", fn.__name__)
            await asyncio.sleep(max(started + interval_s - loop.time(), 0.0))

    async def _spread(self, interval_s: float, fn: Callable[[ReplicaRecord], Awaitable[None]],
                      records: Sequence[ReplicaRecord]) -> None:
        """``fn`` of every record: at once up to ``poll_batch`` records, else in batches of
        that size started evenly over ``interval_s`` (one batch's GETs per wake-up, not the
        fleet's); returns when every batch has ended."""
        batch = self.config.poll_batch
        if batch <= 0 or len(records) <= batch:
            await asyncio.gather(*(fn(r) for r in records))
            return
        loop = asyncio.get_running_loop()
        starts = range(0, len(records), batch)
        gap_s = interval_s / len(starts)
        begun = loop.time()
        running: list[asyncio.Future[list[None]]] = []
        try:
            for i, first in enumerate(starts):
                if i:
                    await asyncio.sleep(max(begun + i * gap_s - loop.time(), 0.0))
                running.append(asyncio.gather(*(fn(r) for r in records[first:first + batch])))
            await asyncio.gather(*running)
        finally:
            for batch_run in running:
                batch_run.cancel()  # (stopped while batches were running; no-op once they ended)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("registry background task failed", exc_info=task.exception())

    # ----------------------------------------------------------------- reading
    def now(self) -> float:
        """Now on the registry's clock (drain deadlines, ejection ends are on it)."""
        return self._clock()

    def ids(self) -> tuple[ReplicaId, ...]:
        """The replicas ``views`` would show, in its order, without building the views."""
        return tuple(self._table.records)

    def views(self) -> tuple[ReplicaView, ...]:
        if self._ejections.ejected:
            self._ejections.expire()
        held = self.held_prefill
        return tuple(r.view(held(r.id)) for r in self._table.records.values())

    def get(self, url: str) -> ReplicaView | None:
        r = self._table.records.get(normalize_url(url))
        return r.view() if r else None

    def memory_bound(self, replica: ReplicaId) -> bool:
        """``ReplicaView.memory_bound`` of a routed replica, without building its view."""
        r = self._table.records.get(replica)
        return bool(r and r.capacity and r.capacity.memory_bound)

    def models(self) -> list[dict[str, Any]]:
        """The model cards of every registered replica, deduplicated by id (first wins)."""
        seen: dict[str, dict[str, Any]] = {}
        for r in self._table.records.values():
            for card in r.model_cards or ():
                seen.setdefault(str(card["id"]), card)
        return list(seen.values())

    def served_models(self) -> frozenset[str]:
        """The model ids some registered replica (in any state) serves; empty while none has
        reported its models. Cached until a replica joins, leaves or reports its models."""
        served = self._served
        if served is None:
            served = self._served = frozenset().union(*(r.models for r in self._table.records.values()))
        return served

    @property
    def degraded_total(self) -> int:
        """Shared-state operations that failed, timed out or were skipped (local fallback)."""
        return self._link.guard.degraded_total if self._link else 0

    @property
    def shared_degraded(self) -> bool:
        return self._link.guard.degraded if self._link else False

    def add_listener(self, listener: RegistryListener) -> None:
        self._table.add_listener(listener)

    # ----------------------------------------------------------------- membership
    async def add(self, url: str) -> ReplicaView:
        rid = normalize_url(url)
        if rid in self._table.records:
            return self._table.records[rid].view()
        rec = self._insert(rid)
        await self._shared_write(lambda s: s.add_member(rid), "add")
        await self._probe(rec)
        return rec.view()

    def _insert(self, rid: ReplicaId) -> ReplicaRecord:
        c = self.config
        return self._table.add(ReplicaRecord(
            id=rid, state=ReplicaState.JOINING, added_at_s=self._clock(), static=rid in self._static,
            health=HealthTracker(c.unhealthy_after_failures, c.healthy_after_successes),
            speed=ReplicaSpeed.seeded(*self._speed_seed) if c.learn_speeds else None))

    def observe_speed(self, url: str, prompt_tokens: int | None, cached_tokens: int | None, ttft_s: float | None,
                      output_tokens: int | None, stream_s: float | None) -> None:
        """A finished stream's usage and timings, for the replica's learned speed (`ReplicaSpeed.observe`)."""
        if (rec := self._table.records.get(normalize_url(url))) is not None and rec.speed is not None:
            rec.speed.observe(prompt_tokens, cached_tokens, ttft_s, output_tokens, stream_s)

    async def remove(self, url: str) -> None:
        rid = self._table.require(url).id
        self._table.remove(rid, "removed")
        self._forget(rid)
        await self._shared_write(lambda s: s.remove_member(rid), "remove")

    # ----------------------------------------------------------------- drain
    async def drain(self, url: str, deadline_s: float | None = None) -> ReplicaView:
        """Stop new requests; remove when empty or ``deadline_s`` seconds from now."""
        rec = self._table.require(url)
        left = self.config.drain_timeout_s if deadline_s is None else max(0.0, deadline_s)
        self._drain_local(rec, left)
        await self._shared_write(lambda s: s.set_drain(rec.id, left), "drain")
        self._check_drain(rec)
        return rec.view()

    def _drain_local(self, rec: ReplicaRecord, left_s: float) -> None:
        was_operator = rec.operator_drain
        now = self._clock()
        started = rec.drain.started_s if rec.drain else now
        self._set_drain(rec, DrainInfo(now + left_s, by_operator=True, started_s=started))
        if not was_operator:
            self._table.set_state(rec, ReplicaState.DRAINING, force_notify=True)

    async def undrain(self, url: str) -> ReplicaView:
        rec = self._table.require(url)
        self._undrain_local(rec)
        await self._shared_write(lambda s: s.clear_drain(rec.id), "undrain")
        return rec.view()

    def _undrain_local(self, rec: ReplicaRecord) -> None:
        if rec.state is ReplicaState.DRAINING:
            rec.drain = None
            self._table.set_state(rec, state_after_undrain(rec.ever_ok, rec.health))

    def set_removal_candidate(self, url: str, flag: bool) -> None:
        rec = self._table.require(url)
        if rec.removal_candidate != flag:
            rec.removal_candidate = flag
            self._table.notify("on_state_changed", rec.view(), rec.state)
        if self._link is not None:
            self._spawn(self._shared_write(lambda s: s.set_candidate(rec.id, flag), "candidate"))

    def check_drains(self) -> None:
        for rec in list(self._table.records.values()):
            self._check_drain(rec)

    def _set_drain(self, rec: ReplicaRecord, info: DrainInfo) -> None:
        """A drain deadline for ``rec``; the drain loop wakes to watch it."""
        rec.drain = info
        self._draining.set()

    async def _check_drains_async(self) -> None:
        """The drain loop's body; it goes back to sleep when nothing drains any more."""
        self.check_drains()
        if not any(r.state is ReplicaState.DRAINING for r in self._table.records.values()):
            self._draining.clear()

    def _check_drain(self, rec: ReplicaRecord) -> None:
        if rec.state is not ReplicaState.DRAINING or rec.drain is None:
            return
        min_empty_s = 2 * self.config.shared.sync_interval_s if self._link is not None else 0.0
        why = drain_outcome(rec.drain, self._clock(), rec.total_in_flight, min_empty_s)
        if why is None or self._table.records.get(rec.id) is not rec:
            return
        self._table.remove(rec.id, f"drained ({why})")
        self._forget(rec.id)
        readd = (
            (not rec.drain.by_operator) and rec.static and self.config.readd_static_after_self_drain
        )
        if readd:
            self._insert(rec.id)
        if self._link is not None:
            self._spawn(self._shared_after_drain(rec.id, readd))

    async def _shared_after_drain(self, rid: ReplicaId, readd: bool) -> None:
        await self._shared_write(lambda s: s.remove_member(rid), "drained")
        if readd:
            await self._shared_write(lambda s: s.add_member(rid), "re-add")

    # ----------------------------------------------------------------- health
    def _apply(self, rec: ReplicaRecord, event: HealthEvent) -> None:
        rec.health.record(event)
        new = next_state(rec.state, event, rec.health, operator_drain=rec.operator_drain)
        if new is rec.state:
            return
        if new is ReplicaState.DRAINING:
            now = self._clock()
            self._set_drain(rec, DrainInfo(
                now + self.config.drain_timeout_s, by_operator=False, started_s=now
            ))
        elif rec.state is ReplicaState.DRAINING:
            rec.drain = None
        self._table.set_state(rec, new)
        self._check_drain(rec)

    def report_failure(self, url: str, reason: str) -> None:
        """A request failed on ``url`` for a reason the replica is to blame for (passive
        health): it counts in the outlier detector, not in the probe hysteresis."""
        rec = self._table.records.get(normalize_url(url))
        if rec is not None:
            log.debug("passive failure on %s: %s", rec.id, reason)
            self._ejections.result(rec, False)

    def report_success(self, url: str) -> None:
        rec = self._table.records.get(normalize_url(url))
        if rec is not None:
            self._ejections.result(rec, True)
            self._apply(rec, HealthEvent.PASSIVE_SUCCESS)

    @property
    def ejections_total(self) -> dict[tuple[ReplicaId, str], int]:
        """Ejections so far, by (replica, reason)."""
        return self._ejections.totals

    def _forget(self, rid: ReplicaId) -> None:
        self._ejections.forget(rid)
        self._probe_log.forget(rid)

    async def probe_all(self) -> None:
        await self._spread(self.config.probe_interval_s, self._probe, list(self._table.records.values()))

    async def _probe(self, rec: ReplicaRecord) -> None:
        timeout = self.config.probe_timeout_s
        res = await probe.probe_readiness(self._get, rec.id, rec.ready_path, timeout)
        if self._table.records.get(rec.id) is not rec:
            return
        rec.ready_path = res.path
        if res.event is HealthEvent.PROBE_OK and rec.capacity is None:
            cap = await probe.fetch_capacity(self._get, rec.id, timeout)
            if cap is None or self._table.records.get(rec.id) is not rec:
                return  # not joined yet: retry at the next probe
            cards = await probe.fetch_models(self._get, rec.id, timeout)
            if self._table.records.get(rec.id) is not rec:
                return
            rec.capacity = probe.with_context(cap, served := probe.served_cards(cards, cap))
            self._set_models(rec, served)
        self._probe_outcome(rec, res)
        self._apply(rec, res.event)

    def _set_models(self, rec: ReplicaRecord, cards: Sequence[dict[str, Any]]) -> None:
        rec.model_cards = tuple(cards)
        rec.models = frozenset(str(card["id"]) for card in cards)
        self._forget_served()

    def _forget_served(self) -> None:
        self._served = None

    def _probe_outcome(self, rec: ReplicaRecord, res: probe.ProbeResult) -> None:
        """Logging (rate-limited) and the outlier side of one probe's result."""
        if res.event is HealthEvent.PROBE_FAILED:
            self._probe_log.failed(rec.id, res.detail)
            if res.timed_out:
                self._ejections.probe_timed_out(rec)
            return
        self._probe_log.answered(rec.id)
        if res.event is HealthEvent.PROBE_OK:
            rec.ever_ok = True
        self._ejections.probe_answered(rec)

    async def poll_loads(self) -> None:
        """The replicas' own loads, for those that have answered a probe and are not
        draining: nothing is routed to a draining replica, and a SIGTERM'd SGLang (its
        ``/ready`` says 503, so it drains) can hang in its exit on a ``/v1/loads`` call
        that arrives after its schedulers stopped (seen in
        ``tests/sglang_real/test_gateway_real.py``; uvicorn then waits for that request)."""
        async def one(rec: ReplicaRecord) -> None:
            got = await probe.fetch_loads(self._get, rec.id, self.config.probe_timeout_s)
            if got is not None:
                rec.set_reported(got)

        await self._spread(self.config.loads_poll_interval_s, one,
                           [r for r in self._table.records.values()
                            if r.ever_ok and r.state is not ReplicaState.DRAINING])

    # ----------------------------------------------------------------- load
    def lease(self, url: str, predicted_uncached_tokens: int) -> LoadLease:
        """Count a request on ``url`` now; the caller releases the lease when done."""
        rid = normalize_url(url)
        rec = self._table.records.get(rid)
        counters = rec.counters if rec is not None else LoadCounters()  # removed meanwhile
        return LoadLease(rid, counters, predicted_uncached_tokens, self._on_release)

    async def reserve(self, candidates: Sequence[str], predicted_uncached_tokens: int) -> LoadLease:
        """Choose-and-reserve across gateways (see SharedState.reserve), then lease.

        Without shared state, or while it is degraded, the first candidate is leased."""
        if not candidates:
            raise ValueError("reserve() needs at least one candidate")
        ids = [normalize_url(c) for c in candidates]
        got = await self._link.reserve(ids, predicted_uncached_tokens) if self._link else None
        return self.lease(got or ids[0], predicted_uncached_tokens)

    def _on_release(self, lease: LoadLease) -> None:
        rec = self._table.records.get(lease.replica)
        if rec is not None and rec.state is ReplicaState.DRAINING:
            self._check_drain(rec)

    # ----------------------------------------------------------------- shared state
    async def _shared_write(self, op: Callable[[SharedState], Awaitable[Any]], what: str) -> None:
        if self._link is not None:
            await self._link.write(op, what)

    async def sync_shared(self) -> None:
        """Publish this gateway's load, read the shared view, apply what changed."""
        if self._link is None:
            return
        got = await self._link.sync(
            {rid: r.counters for rid, r in self._table.records.items()}, self._republish
        )
        if got is None:
            for r in self._table.records.values():
                r.remote = LoadCounters()
            return
        self._apply_diff(*got)

    async def _republish(self) -> None:
        recs = list(self._table.records.values())
        now = self._clock()
        drains: dict[str, float] = {
            r.id: max(0.0, r.drain.deadline_s - now)
            for r in recs
            if r.drain and r.drain.by_operator
        }
        cands = [r.id for r in recs if r.removal_candidate]
        await self._shared_write(
            lambda s: s.republish([r.id for r in recs], drains, cands), "republish"
        )

    def _apply_diff(self, diff: SharedDiff, snap: SharedSnapshot) -> None:
        for url in diff.add:
            self._spawn(self._probe(self._insert(normalize_url(url))))
        for url in diff.remove:
            self._table.remove(normalize_url(url), "removed (shared)")
            self._forget(normalize_url(url))
        for url, left in diff.drain.items():
            rec = self._table.records.get(normalize_url(url))
            if rec is not None:
                self._drain_local(rec, left)
        for url in diff.undrain:
            rec = self._table.records.get(normalize_url(url))
            if rec is not None and rec.operator_drain:
                self._undrain_local(rec)
        for url, flag in diff.candidates.items():
            rec = self._table.records.get(normalize_url(url))
            if rec is not None and rec.removal_candidate != flag:
                rec.removal_candidate = flag
                self._table.notify("on_state_changed", rec.view(), rec.state)
        for rid, rec in self._table.records.items():
            rec.remote = snap.remote_load.get(rid) or LoadCounters()
        self.check_drains()


class _ForgetServed:
    """Registry listener: a replica joining or leaving changes the models served."""

    def __init__(self, forget: Callable[[], None]) -> None:
        self._forget = forget

    def on_added(self, view: ReplicaView) -> None:
        self._forget()

    def on_removed(self, replica_id: ReplicaId) -> None:
        self._forget()

    def on_state_changed(self, view: ReplicaView, old_state: ReplicaState) -> None:
        pass
