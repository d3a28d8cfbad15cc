"""Benchmark: prefix-index lookups and decisions, embedded vs Redis (issue 4 "How fast").

The index holds ``--replicas`` replicas x ``--tokens-per-replica`` tokens (64 replicas x
2M tokens = 64 x 31,250 blocks by default): a shared 64-block system prompt on every
replica, the request's own 1,500-block chain on replica 0 (and partly on replicas 1-3),
and random chains filling each replica to its capacity. Measured:
- lookup: ``match(chain, all replicas)`` p50/p99;
- decision: match + get_session + record + set_session (what one routed request costs
  the index) for ``--sessions`` interleaved conversations of ~``--chain-blocks`` blocks
  that grow by ``--turn-blocks`` a turn (so records mostly extend an older chain, the real
  case): wall p50/p99, client CPU, and Redis CPU per decision (``INFO commandstats``: the
  server's own time in the commands, robust on a busy machine);
- memory: process RSS growth for the embedded index, ``used_memory`` for Redis.

    python -m loadtest.bench_index            # starts its own redis-server on a free port
    python -m loadtest.bench_index --policy 8,64,512   # the cache-aware decision alone

``--policy``: the `cache-aware` policy's ``decide`` alone (no index) over N replicas of
2M device + 4M host tokens with seeded random loads, working sets and learned speeds, half holding a
64-block shared prompt: a session's 100k-token turn (its home holds 1,500 blocks) and a
new session's first turn (the placement and new-session terms apply). ``--with-policy``:
the timed decisions also run that decision over the index's matches. ``--churn N``: N
records of new chains on one full compact replica (each evicts as many blocks: the table
work the compact store bounds per call). ``--switch``: the default index's one-time
conversion from the segment to the compact representation when its 32nd replica joins 31
full ones (one replica per write: the longest write and all of them). ``--truncated``: after the fill, one feedback truncation on every replica.
Embedded backends (``--backends``): ``memory`` (the default configuration: its
representation chosen by fleet size), ``compact`` and ``segments`` (each representation
forced). Results: docs/results-cost.md, docs/benchmarks.md section 5.1.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from loadtest.percentile import percentile
from loadtest.simulator.ports import free_port
from policies.base import RequestContext, RoutingInputs, SessionKeys
from policies.registry import make_policy
from prefix_index.base import PrefixIndex, PrefixMatch, ReplicaCapacity, ReplicaId, SessionEntry
from prefix_index.compact import CompactPrefixIndex
from prefix_index.config import IndexConfig
from prefix_index.factory import make_index
from prefix_index.local_index import COMPACT_FROM_REPLICAS, FleetSizedIndex
from prefix_index.redis_backend import RedisPrefixIndex
from prefix_index.segments import SegmentPrefixIndex
from replicas.model import ReplicaState, ReplicaView


@dataclass(frozen=True)
class IndexWorkload:
    """Chains are made on demand from per-replica seeds (at 512 replicas x 6M tokens the
    fill is 48M block hashes: kept as Python ints they would outweigh the index)."""

    replicas: list[ReplicaId]
    capacity: ReplicaCapacity
    shared: list[int]
    chain_blocks: int
    request: list[int]
    sessions: list[list[int]]  # conversations for decisions: shared prompt + own blocks
    seed: int = 0

    def fills(self, i: int) -> Iterator[list[int]]:
        """Replica ``i``'s chains to record, oldest first: random chains behind the shared
        prompt up to its capacity, then (replicas 0-3) a prefix of the request."""
        rng = np.random.default_rng([self.seed, i])
        total = self.capacity.device_blocks + self.capacity.host_blocks
        held, k = 0, len(self.shared)
        while held < total:
            n = max(min(self.chain_blocks, total - held + k), k + 1)  # at least one own block
            yield self.shared + rng.integers(0, 2**64, size=n - k, dtype=np.uint64, endpoint=False).tolist()
            held += n - k
        partial = {0: self.chain_blocks, 1: 1000, 2: 500, 3: 200}.get(i)
        if partial:
            yield self.request[:partial]


def make_workload(
    n_replicas: int, blocks_per_replica: int, chain_blocks: int, n_sessions: int = 100, seed: int = 0,
    host_blocks_per_replica: int = 0,
) -> IndexWorkload:
    rng = random.Random(seed)
    shared = [rng.getrandbits(64) for _ in range(64)]
    request = shared + [rng.getrandbits(64) for _ in range(chain_blocks - len(shared))]
    replicas = [ReplicaId(f"http://10.0.0.{i}:30000") for i in range(n_replicas)]
    sessions = [shared + [rng.getrandbits(64) for _ in range(chain_blocks - len(shared))] for _ in range(n_sessions)]
    capacity = ReplicaCapacity(blocks_per_replica, host_blocks_per_replica)
    return IndexWorkload(replicas, capacity, shared, chain_blocks, request, sessions, seed)


async def populate(index: PrefixIndex, w: IndexWorkload) -> None:
    for i, rid in enumerate(w.replicas):
        await index.set_capacity(rid, w.capacity)
        for chain in w.fills(i):
            await index.record(rid, chain)


def _pct(samples: Sequence[float], q: float) -> float:
    """``q`` as a fraction (0.99), the project's one percentile (loadtest.percentile)."""
    return percentile(samples, q * 100) or 0.0


async def time_lookups(index: PrefixIndex, w: IndexWorkload, n: int) -> tuple[list[float], list[float]]:
    """Wall and CPU (this process) seconds of each ``match``: CPU is robust on a busy machine."""
    wall, cpu = [], []
    for _ in range(n):
        t, c = time.perf_counter(), time.process_time()
        await index.match(w.request, w.replicas)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return wall, cpu


@dataclass(frozen=True)
class Decisions:
    wall: list[float]
    cpu: list[float]  # this process
    per_s: float
    kept: float  # share of returning turns whose replica still held the previous turn's chain


Decide = Callable[[list[int], dict[ReplicaId, PrefixMatch], SessionEntry | None], object]


async def time_decisions(index: PrefixIndex, w: IndexWorkload, n: int, turn_blocks: int, seed: int = 1,
                         after_first_turns: Callable[[], None] = lambda: None,
                         decide: Decide | None = None) -> Decisions:
    """``n`` decisions, each one turn of a session picked round-robin (match + session read +
    record + session write): the session's chain grows by ``turn_blocks`` new blocks a turn
    and is recorded on its replica (the session's replica; a new session gets replica
    ``s % replicas``). Every session's first turn (a new 1,500-block chain) runs first,
    untimed, then ``after_first_turns()``: the timed decisions are follow-up turns.
    ``decide`` (``--with-policy``): also timed, between the reads and the writes (its pick
    is not used, so the workload stays the same)."""
    rng = random.Random(seed)
    chains = [list(c) for c in w.sessions]
    wall: list[float] = []
    cpu: list[float] = []
    kept, returning = 0, 0
    t0 = time.perf_counter()
    for i in range(-len(chains), n):
        if i == 0:
            after_first_turns()
            wall, cpu, kept, returning = [], [], 0, 0
            t0 = time.perf_counter()
        s = i % len(chains)
        chains[s].extend(rng.getrandbits(64) for _ in range(turn_blocks))
        chain = chains[s]
        t, c = time.perf_counter(), time.process_time()
        matches = await index.match(chain, w.replicas)
        session = await index.get_session(f"s{s}")
        if decide is not None:
            decide(chain, matches, session)
        best = session.replica if session else w.replicas[s % len(w.replicas)]
        await index.record(best, chain)
        await index.set_session(f"s{s}", SessionEntry(best, len(chain) * 64, time.time()))
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        if session is not None:
            returning += 1
            kept += matches[best].blocks >= len(chain) - turn_blocks
    return Decisions(wall, cpu, n / (time.perf_counter() - t0), kept / max(returning, 1))


def _decision_stats(d: Decisions) -> dict[str, float]:
    return {"decision_p50_us": _pct(d.wall, 0.5) * 1e6, "decision_p99_us": _pct(d.wall, 0.99) * 1e6,
            "decision_max_us": max(d.wall, default=0.0) * 1e6,
            "decision_cpu_p50_us": _pct(d.cpu, 0.5) * 1e6, "decision_cpu_p99_us": _pct(d.cpu, 0.99) * 1e6,
            "decision_cpu_max_us": max(d.cpu, default=0.0) * 1e6, "decisions_per_s": d.per_s,
            "prefix_kept": d.kept}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _redis_cpu(client: redis.Redis) -> float:
    """Redis server CPU seconds so far (user + sys, from INFO cpu)."""
    cpu = client.info("cpu")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


EMBEDDED = ("memory", "segments", "compact")


def embedded_index(backend: str) -> PrefixIndex:
    """The embedded backend exactly as the gateway builds it (``prefix_index.factory``):
    ``memory`` is the default configuration (its representation chosen by fleet size),
    ``compact`` forces the compact representation; ``segments`` forces the segment one
    (no configuration does: the default's representation below its threshold)."""
    if backend not in EMBEDDED:
        raise ValueError(f"not an embedded backend: {backend!r}")
    if backend == "segments":
        return SegmentPrefixIndex()
    return make_index(IndexConfig.model_validate({"backend": backend}))


def policy_decider(w: IndexWorkload) -> Decide:
    """``--with-policy``: the cache-aware decision over the index's matches, replicas with
    the seeded loads and working sets of ``--policy`` (`policy_inputs`)."""
    policy = make_policy("cache-aware", {}, 0)
    rng = policy.new_rng()
    _, base = policy_inputs(len(w.replicas), False, 0)

    def decide(chain: list[int], matches: dict[ReplicaId, PrefixMatch], session: SessionEntry | None) -> object:
        tokens = len(chain) * 64
        ctx = RequestContext("r", "chat", "m", SessionKeys("s"), tuple(chain), tokens * 4, tokens, 64, 256)
        inputs = RoutingInputs(base.replicas, matches, session, None, base.resident_tokens, base.now_s)
        return policy.decide(ctx, inputs, rng)
    return decide


async def truncate_others(index: PrefixIndex, w: IndexWorkload, seed: int = 3) -> None:
    """``--truncated``: on every replica one session's chain (the shared prompt + 100 blocks)
    recorded, then truncated to 80 blocks by feedback: a gap on a chain the request does
    not hold, on every replica."""
    rng = random.Random(seed)
    for rid in w.replicas:
        chain = w.shared + [rng.getrandbits(64) for _ in range(100)]
        await index.record(rid, chain)
        await index.truncate(rid, chain, 80)


async def bench_embedded(backend: str, w: IndexWorkload, n: int, turn_blocks: int,
                         freeze: bool, with_policy: bool = False, truncated: bool = False) -> dict[str, float]:
    """Fill, then time lookups and decisions; RSS is the process's growth over the fill
    (``freeze``: ``gc.freeze()`` after it, as a gateway would after start-up)."""
    gc.collect()
    rss0, t0 = _rss_bytes(), time.perf_counter()
    index = embedded_index(backend)
    await populate(index, w)
    if truncated:
        await truncate_others(index, w)
    fill_s = time.perf_counter() - t0
    if isinstance(index, FleetSizedIndex):
        print(f"{backend}: {len(w.replicas)} replicas -> the {index.representation} representation")
    gc.collect()
    if freeze:
        gc.freeze()
    rss = _rss_bytes() - rss0
    blocks = w.capacity.device_blocks + w.capacity.host_blocks
    wall, cpu = await time_lookups(index, w, n)
    out = {"fill_s": fill_s, "rss_mb": rss / 2**20, "bytes_per_block": rss / max(blocks * len(w.replicas), 1),
           **_lookup_stats(wall, cpu)}
    decide = policy_decider(w) if with_policy else None
    out.update(_decision_stats(await time_decisions(index, w, n, turn_blocks, decide=decide)))
    del index
    gc.unfreeze()
    gc.collect()
    return out


def _lookup_stats(wall: list[float], cpu: list[float]) -> dict[str, float]:
    return {"p50_us": _pct(wall, 0.5) * 1e6, "p99_us": _pct(wall, 0.99) * 1e6,
            "max_us": max(wall, default=0.0) * 1e6,
            "cpu_p50_us": _pct(cpu, 0.5) * 1e6, "cpu_p99_us": _pct(cpu, 0.99) * 1e6,
            "cpu_max_us": max(cpu, default=0.0) * 1e6}


def _redis_usec(client: redis.Redis) -> float:
    """Microseconds the server spent in commands since the last CONFIG RESETSTAT."""
    stats = client.info("commandstats")
    return sum(float(v["usec"]) for k, v in stats.items() if k != "cmdstat_config")


def _redis_calls(client: redis.Redis) -> float:
    """Commands the server ran since the last CONFIG RESETSTAT (one round trip each unless
    pipelined: write-behind batches several into one)."""
    stats = client.info("commandstats")
    return sum(float(v["calls"]) for k, v in stats.items() if k not in ("cmdstat_config", "cmdstat_info"))


async def _redis_decisions(
    idx: RedisPrefixIndex, client: redis.Redis, w: IndexWorkload, n: int, turn_blocks: int, seed: int
) -> dict[str, float]:
    """Decisions on Redis; server time per first turn, and per follow-up decision."""
    first: dict[str, float] = {}
    cpu0 = [0.0]

    def first_turns_done() -> None:
        first["redis_us_per_first_turn"] = _redis_usec(client) / len(w.sessions)
        client.config_resetstat()
        cpu0[0] = _redis_cpu(client)

    client.config_resetstat()
    dec = await time_decisions(idx, w, n, turn_blocks, seed, after_first_turns=first_turns_done)
    await idx.flush()
    return {**_decision_stats(dec), **first, "redis_us_per_decision": _redis_usec(client) / n,
            "redis_commands_per_decision": _redis_calls(client) / n,
            "redis_cpu_us_per_decision": (_redis_cpu(client) - cpu0[0]) / n * 1e6}


async def bench_redis(w: IndexWorkload, n: int, url: str, turn_blocks: int) -> dict[str, dict[str, float]]:
    """Fill once; time lookups (chain search and exact), then decisions (awaited, write-behind)."""
    client = redis.Redis.from_url(url)
    base = IndexConfig(backend="redis", redis_url=url, redis_timeout_s=1.0)
    # the fill awaits every write: a write-behind fill would read used_memory while most
    # of its writes are still queued (and drop the oldest past redis_queue_max)
    index = RedisPrefixIndex(base.model_copy(update={"redis_write_behind": False}))
    t0 = time.perf_counter()
    await populate(index, w)
    if index.degraded_total:
        raise RuntimeError(f"the Redis fill degraded ({index.degraded_total} calls missed Redis)")
    used = int(client.info("memory")["used_memory"])
    blocks = (w.capacity.device_blocks + w.capacity.host_blocks) * len(w.replicas)
    fill = {"fill_s": time.perf_counter() - t0, "used_memory_mb": used / 2**20, "bytes_per_block": used / blocks}
    results: dict[str, dict[str, float]] = {}
    for mode, exact in (("redis", False), ("redis-exact", True)):
        idx = RedisPrefixIndex(base.model_copy(update={"redis_exact_match": exact}))
        await time_lookups(idx, w, 20)  # warm-up (script load)
        client.config_resetstat()
        cpu0 = _redis_cpu(client)
        wall, cpu = await time_lookups(idx, w, n)
        results[mode] = {**(fill if not exact else {}), **_lookup_stats(wall, cpu),
                         "redis_us_per_lookup": _redis_usec(client) / n,
                         "redis_cpu_us_per_lookup": (_redis_cpu(client) - cpu0) / n * 1e6,
                         "degraded_total": float(idx.degraded_total)}
        await idx.close()
    for mode, behind in (("redis", False), ("redis-write-behind", True)):
        idx = RedisPrefixIndex(base.model_copy(update={"redis_write_behind": behind}))
        await time_lookups(idx, w, 5)
        results.setdefault(mode, {}).update(await _redis_decisions(idx, client, w, n, turn_blocks, 2 if behind else 1))
        await idx.close()
    await index.close()
    client.close()
    return results


def policy_inputs(n: int, new_session: bool, seed: int) -> tuple[RequestContext, RoutingInputs]:
    """One decision's inputs for ``--policy`` (see the module docstring)."""
    rng = random.Random(seed)
    views = tuple(ReplicaView(
        ReplicaId(f"http://10.0.0.{i}:30000"), ReplicaState.ACTIVE, 2_000_000, 4_000_000, 64, 64,
        in_flight=rng.randint(0, 40), pending_prefill_tokens=rng.randint(0, 200_000), decoding=rng.randint(0, 40),
        reported_running=rng.randint(0, 40), reported_waiting=rng.randint(0, 8),
        reported_waiting_uncached_tokens=rng.randint(0, 200_000),
        prefill_tokens_per_s=rng.uniform(30_000, 60_000), decode_step_s=rng.uniform(0.012, 0.02)) for i in range(n))
    matches = {v.id: PrefixMatch(64 if i % 2 else 0) for i, v in enumerate(views)}
    session = None if new_session else SessionEntry(views[0].id, 96_000, 0.0)
    if session is not None:
        matches[views[0].id] = PrefixMatch(1_000, 500)
    tokens = 4_096 if new_session else 96_000
    ctx = RequestContext("r", "chat", "m", SessionKeys("s"), tuple(range(tokens // 64)), tokens * 4, tokens, 64, 256)
    resident = {v.id: rng.randint(0, 6_000_000) for v in views}
    return ctx, RoutingInputs(views, matches, session, None, resident, 1_000.0)


def bench_policy(n: int, iterations: int) -> dict[str, float]:
    """Wall and CPU microseconds of ``cache-aware``'s ``decide`` at ``n`` replicas."""
    policy = make_policy("cache-aware", {}, 0)
    rng = policy.new_rng()
    out: dict[str, float] = {}
    for case, new in (("turn", False), ("new", True)):
        cases = [policy_inputs(n, new, s) for s in range(20)]
        wall, cpu = [], []
        for i in range(iterations):
            c, inputs = cases[i % len(cases)]
            t, p = time.perf_counter(), time.process_time()
            policy.decide(c, inputs, rng)
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - p)
        out.update({f"{case}_{k}": v for k, v in _lookup_stats(wall, cpu).items()})
    return out


def bench_churn(blocks: int, chain_blocks: int, records: int, seed: int = 0) -> dict[str, float]:
    """``--churn``: one compact replica of ``blocks`` blocks (a third on device) filled, then
    ``records`` chains of ``chain_blocks`` new blocks (each evicts as many): wall time per
    ``record`` and table slots moved per call (tidying; the old table rehashed here)."""
    index = CompactPrefixIndex(default_capacity=ReplicaCapacity(blocks // 3, blocks - blocks // 3))
    rid, rng = ReplicaId("r"), np.random.default_rng(seed)
    chains = (rng.integers(0, 2**64, size=chain_blocks, dtype=np.uint64, endpoint=False).tolist() for _ in iter(int, 1))
    for _ in range(blocks // chain_blocks + 1):
        index.record_now(rid, next(chains))
    store, wall, cpu, moved = index._store, [], [], []
    for _ in range(records):
        chain, m, t, c = next(chains), getattr(store, "moved", 0), time.perf_counter(), time.process_time()
        index.record_now(rid, chain)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        moved.append(getattr(store, "moved", 0) - m)
    return {**_lookup_stats(wall, cpu), "moved_per_call_max": float(max(moved)),
            "moved_per_call_mean": sum(moved) / len(moved)}


async def bench_switch(w: IndexWorkload) -> dict[str, float]:
    """``--switch``: the default index filled on ``COMPACT_FROM_REPLICAS - 1`` replicas of the
    workload (the segment representation; ``--replicas`` is not used), then the write that
    adds one more replica and starts the switch to the compact one, and the writes after it
    (a one-block record on the new replica each) until every replica moved over: the writes
    it took, the longest one's and all of them's wall and CPU time, and RSS before and
    after."""
    index = make_index(IndexConfig())
    assert isinstance(index, FleetSizedIndex)
    gc.collect()
    rss0 = _rss_bytes()
    for i in range(COMPACT_FROM_REPLICAS - 1):
        rid = ReplicaId(f"http://10.0.0.{i}:30000")
        await index.set_capacity(rid, w.capacity)
        for chain in w.fills(i):
            await index.record(rid, chain)
    gc.collect()
    rss1 = _rss_bytes()
    new = ReplicaId("http://10.0.1.0:30000")
    walls: list[float] = []
    cpus: list[float] = []
    while index.representation != "compact" and len(walls) <= COMPACT_FROM_REPLICAS:
        t, c = time.perf_counter(), time.process_time()
        if walls:
            await index.record(new, [len(walls)])
        else:
            await index.set_capacity(new, w.capacity)
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    if index.representation != "compact":
        raise RuntimeError("the default index did not switch")
    gc.collect()
    return {"switch_writes": float(len(walls)), "switch_max_write_ms": max(walls) * 1e3,
            "switch_max_write_cpu_ms": max(cpus) * 1e3, "switch_total_ms": sum(walls) * 1e3,
            "switch_total_cpu_ms": sum(cpus) * 1e3, "rss_segments_mb": (rss1 - rss0) / 2**20,
            "rss_compact_mb": (_rss_bytes() - rss0) / 2**20}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--tokens-per-replica", type=int, default=2_000_000, help="device KV tokens per replica")
    parser.add_argument("--host-tokens-per-replica", type=int, default=0, help="host (HiCache) KV tokens per replica")
    parser.add_argument("--backends", default="memory,compact",
                        help="embedded backends to measure: memory (the default configuration), compact, segments")
    parser.add_argument("--no-gc-freeze", action="store_true", help="do not gc.freeze() after the fill")
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument("--chain-blocks", type=int, default=1500, help="request size in blocks (1,500 = ~100k tokens)")
    parser.add_argument("--iterations", type=int, default=2000, help="lookups, and decisions, per backend")
    parser.add_argument("--sessions", type=int, default=100, help="interleaved conversations in the decision loop")
    parser.add_argument("--turn-blocks", type=int, default=8, help="new blocks a turn adds (~500 tokens)")
    parser.add_argument("--redis-url", default=None, help="use this Redis instead of starting one (it is FLUSHED)")
    parser.add_argument("--skip-redis", action="store_true")
    parser.add_argument("--policy", default=None, metavar="N,N,...",
                        help="only time the cache-aware decision (no index) at these fleet sizes")
    parser.add_argument("--with-policy", action="store_true",
                        help="embedded backends: the timed decision includes the cache-aware policy's decide")
    parser.add_argument("--truncated", action="store_true",
                        help="embedded backends: after the fill, one feedback truncation on every replica "
                             "(of a chain the request does not hold)")
    parser.add_argument("--switch", action="store_true",
                        help=f"only time the default index's switch to the compact representation when a "
                             f"replica joins {COMPACT_FROM_REPLICAS - 1} filled ones (every write until it is done)")
    parser.add_argument("--churn", type=int, default=0, metavar="RECORDS",
                        help="only time RECORDS records of --chain-blocks new blocks on one compact replica "
                             "of (--tokens-per-replica + --host-tokens-per-replica) tokens")


def run(args: argparse.Namespace) -> int:
    if args.chain_blocks <= 64:
        raise SystemExit("--chain-blocks must exceed the 64-block shared prompt")
    if args.policy:
        for n in [int(x) for x in args.policy.split(",")]:
            res = bench_policy(n, args.iterations)
            print(f"policy {n:4d} replicas " + "  ".join(f"{k}={v:,.0f}" for k, v in res.items()))
        print("load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
        return 0
    bt = args.block_tokens
    if args.churn:
        res = bench_churn((args.tokens_per_replica + args.host_tokens_per_replica) // bt, args.chain_blocks, args.churn)
        print("churn " + "  ".join(f"{k}={v:,.1f}" for k, v in res.items()))
        print("load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
        return 0
    w = make_workload(args.replicas, args.tokens_per_replica // bt, args.chain_blocks, args.sessions,
                      host_blocks_per_replica=args.host_tokens_per_replica // bt)
    if args.switch:
        res = asyncio.run(bench_switch(w))
        print("switch " + "  ".join(f"{k}={v:,.1f}" for k, v in res.items()))
        print("load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
        return 0
    print(f"index: {args.replicas} replicas x ({w.capacity.device_blocks} device + {w.capacity.host_blocks} host) "
          f"blocks; request: {len(w.request)} blocks; {args.iterations} lookups")
    n, turn = args.iterations, args.turn_blocks
    results: dict[str, dict[str, float]] = {}
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        t0 = time.perf_counter()
        results[backend] = asyncio.run(bench_embedded(backend, w, n, turn, not args.no_gc_freeze, args.with_policy,
                                                      args.truncated))
        results[backend]["bench_s"] = time.perf_counter() - t0
    if not args.skip_redis:
        results.update(_with_redis(args.redis_url, lambda url: asyncio.run(bench_redis(w, n, url, turn))))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    for name, res in results.items():
        print(f"{name:11s} " + "  ".join(f"{k}={v:,.1f}" for k, v in res.items()))
    print(f"load average {load}")
    if "redis" in results and "memory" in results:
        mem, red = results["memory"], results["redis"]
        print(f"lookup: redis adds p50 {red['p50_us'] - mem['p50_us']:,.0f} us wall over memory; "
              f"redis server {red['redis_us_per_lookup']:,.0f} us + client CPU {red['cpu_p50_us']:,.0f} us "
              f"vs memory CPU {mem['cpu_p50_us']:,.0f} us")
        print(f"decision: redis adds p50 {red['decision_p50_us'] - mem['decision_p50_us']:,.0f} us wall over "
              f"memory (p99 {red['decision_p99_us']:,.0f} vs {mem['decision_p99_us']:,.0f} us); redis server "
              f"{red['redis_us_per_decision']:,.0f} us + client CPU {red['decision_cpu_p50_us']:,.0f} us "
              f"vs memory CPU {mem['decision_cpu_p50_us']:,.0f} us; "
              f"CPU ratio (server + client) / memory = "
              f"{(red['redis_us_per_decision'] + red['decision_cpu_p50_us']) / mem['decision_cpu_p50_us']:.1f}")
    return 0


def _with_redis(url: str | None, fn: Any) -> dict[str, dict[str, float]]:
    if url:
        redis.Redis.from_url(url).flushdb()
        result: dict[str, dict[str, float]] = fn(url)
        return result
    tmp, port = tempfile.mkdtemp(prefix="kvgate-bench-redis-"), free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", tmp, "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        result = fn(url)
        return result
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_index", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
